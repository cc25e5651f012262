#!/usr/bin/env bash
# compare_rdma.sh: hcomm's verbs transport next to perftest and UCX (UCT
# rc_verbs) between two QEMU guests on Soft-RoCE, in ONE run of
# tests/qemu/run-rdma.sh pair (guest A 10.0.0.1 = server = hcomm rank 1,
# guest B 10.0.0.2 = client = hcomm rank 0, the initiator: every tool's
# initiator runs in guest B and its target in guest A), one benchmark after
# the other.
#
#   bench/compare_rdma.sh BUILD_DIR        (needs BUILD_DIR/tools/hcomm-bench, hcomm-probe)
#   bench/compare_rdma.sh BUILD_DIR lat N  the 8-byte latency rows only, N rounds in the
#       same boot, interleaved (round k: hcomm put/put_nbi/get/fetch_add, then
#       perftest, then UCX, -n 1000 each; hcomm with --batch 1: the median of single
#       iterations, as perftest and UCX report), so that each round's ratios pair tools
#       measured seconds apart; the table gives every round's ratio and their median
#       with its 95% confidence interval (order statistics; from 6 rounds)
#       (HCOMM_LAT_ENV="VAR=VALUE ..." is set for hcomm's rounds only, e.g. to try a knob).
#       HCOMM_LAT_BASE=FILE: an hcomm-bench built from another commit, linked statically
#       (meson setup B --buildtype=release -Ddefault_library=static; ninja -C B tools/hcomm-bench),
#       also runs the four ops in every round, before hcomm's in odd rounds and after it in
#       even ones; the table adds this build's time over the base's, paired by round.
#       get and fetch_add run twice per round: hcomm's target waiting in a barrier
#       (it naps, as perftest's server sleeps: the row against perftest) and polling
#       its memory (--passive spin, as ucx_perftest's target does: the row against UCX)
#
# Each guest first prints `hcomm-probe rdma`. Then, per op:
#   lat 8 B    hcomm-bench put/put_nbi/get/fetch_add lat   | ib_write_lat, ib_read_lat,
#              (-n 200; put waits for its completion at the
#              target, put_nbi does not, like the others)
#              ib_atomic_lat (-n 200)                      | ucx_perftest put_lat, get -O 1, fadd -O 1
#              (get, fetch_add again with --passive spin: the hcomm/UCX ratio of those rows)
#   bw         hcomm-bench put/get bw, 64K 256K 1M 4M      | ib_write_bw, ib_read_bw   | put_bw, get (zcopy)
#   send/recv  hcomm-bench send_recv bw 1M (next to its own put bw 1M), rendezvous by write
#              (the default), then again with HCOMM_RNDV=get (by the receiver's READ)
# and prints one table of time per operation (us): latency rows are medians
# (hcomm p50, perftest t_typical, UCX typical); bandwidth rows are hcomm's
# median window / window, perftest's and UCX's average (perftest / UCX MB/s are
# MiB/s). Ratios are hcomm / peer (< 1: hcomm faster). TCG makes absolute
# numbers meaningless: read the ratios.
# Writes BUILD_DIR/compare-rdma/{console.txt,table.md}; the exit status is run-rdma's.
# Environment: HCOMM_RDMA_TIMEOUT (default 1500 s per guest), HCOMM_RDMA_MEM (1024M).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -eq 1 ] || [ $# -eq 3 -a "${2:-}" = lat ] || { sed -n '2,/^set -e/p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
build=$(cd "$1" && pwd)
rounds=0
[ $# -eq 3 ] && rounds=$3
[[ $rounds =~ ^[0-9]+$ ]] || { echo "compare_rdma: rounds must be a number" >&2; exit 2; }
for t in hcomm-bench hcomm-probe; do
  [ -x "$build/tools/$t" ] || { echo "compare_rdma: $build/tools/$t missing (ninja -C $1 tools/$t)" >&2; exit 2; }
done
out=$build/compare-rdma
mkdir -p "$out"
base=""
if [ -n "${HCOMM_LAT_BASE:-}" ]; then
  [ "$rounds" -gt 0 ] || { echo "compare_rdma: HCOMM_LAT_BASE needs lat N" >&2; exit 2; }
  [ -x "$HCOMM_LAT_BASE" ] || { echo "compare_rdma: HCOMM_LAT_BASE: $HCOMM_LAT_BASE is not an executable" >&2; exit 2; }
  ! ldd "$HCOMM_LAT_BASE" | grep -q libhcomm || { echo "compare_rdma: HCOMM_LAT_BASE must link libhcomm statically" >&2; exit 2; }
  base=$out/hcomm-bench-base
  cp "$HCOMM_LAT_BASE" "$base"
fi
cmds=$out/compare.cmds

# ---- the command list (tests/qemu/run-rdma.sh's format; the perftest and UCX
# lines are built as its built-in list builds them) ----
port=18600   # perftest / ucx_perftest
mport=29600  # hcomm MASTER_PORT
nice='renice -n 19 -p $$ >/dev/null;'  # what hcomm-rdma does for perftest: rxe's kernel threads preempt at once
# peer NAME TIMEOUT TOOL ARGS: server and client lines for perftest / ucx_perftest
peer() {
  local name=$1 t=$2 tool=$3 env="" pt
  shift 3
  case $tool in
    ucx_perftest) env="UCX_IB_GID_INDEX=\$HCOMM_GID " pt="$tool -d \$HCOMM_DEV:1 -x rc_verbs -p $port $*" ;;
    *) pt="$tool -d \$HCOMM_DEV -x \$HCOMM_GID -F -p $port $*" ;;
  esac
  echo "server $name $t ${env}hcomm-rdma server $pt"
  echo "client $name $t ${env}hcomm-rdma client 60 $pt \$HCOMM_PEER"
  port=$((port + 1))
}
# hcomm NAME TIMEOUT BENCH-ARGS: rank 0 (the initiator) in the client guest, as perftest's
# and ucx_perftest's clients initiate, prints its JSON as HCOMM-BENCH NAME lines
hcomm() {
  local name=$1 t=$2 env
  shift 2
  env="${HENV:-}${HENV:+ }HCOMM_TRANSPORTS=verbs WORLD_SIZE=2 MASTER_PORT=$mport"
  echo "server $name $t $nice $env RANK=1 MASTER_ADDR=\$HCOMM_PEER ${BENCH:-hcomm-bench} $*"
  echo "client $name $t $nice $env RANK=0 MASTER_ADDR=\$HCOMM_IP ${BENCH:-hcomm-bench} $* --json -o /tmp/$name.json && sed 's/^/HCOMM-BENCH $name /' /tmp/$name.json"
  mport=$((mport + 1))
}
if [ "$rounds" -gt 0 ]; then
  {
    echo "all probe 30 hcomm-probe rdma && hcomm-probe --json rdma"
    echo "client ping 60 ping -c 1 -w 60 \$HCOMM_PEER"
    for k in $(seq 1 "$rounds"); do
      lat="-t put,put_nbi,get,fetch_add -m lat -s 8 -n 1000 --warmup 50 --batch 1"
      if [ -n "$base" ] && [ $((k % 2)) = 1 ]; then BENCH=hcomm-bench-base hcomm "hbase_lat_r$k" 400 $lat; fi
      HENV="${HCOMM_LAT_ENV:-}" hcomm "hcomm_lat_r$k" 400 $lat
      if [ -n "$base" ] && [ $((k % 2)) = 0 ]; then BENCH=hcomm-bench-base hcomm "hbase_lat_r$k" 400 $lat; fi
      HENV="${HCOMM_LAT_ENV:-}" hcomm "hcomm_lats_r$k" 400 -t get,fetch_add -m lat -s 8 -n 1000 --warmup 50 --batch 1 --passive spin
      peer "write_lat_r$k" 200 ib_write_lat -s 8 -n 1000
      peer "read_lat_r$k" 200 ib_read_lat -s 8 -n 1000
      peer "atomic_lat_r$k" 200 ib_atomic_lat -n 1000
      peer "ucx_put_lat_r$k" 200 ucx_perftest -t put_lat -s 8 -n 1000 -w 50
      peer "ucx_get_lat_r$k" 200 ucx_perftest -t get -D bcopy -s 8 -n 1000 -w 50 -O 1
      peer "ucx_fadd_lat_r$k" 200 ucx_perftest -t fadd -n 1000 -w 50 -O 1
    done
  } > "$cmds"
else
{
  echo "all probe 30 hcomm-probe rdma && hcomm-probe --json rdma"
  echo "client ping 60 ping -c 1 -w 60 \$HCOMM_PEER"
  hcomm hcomm_lat 240 -t put,put_nbi,get,fetch_add -m lat -s 8 -n 200 --warmup 20
  hcomm hcomm_lats 240 -t get,fetch_add -m lat -s 8 -n 200 --warmup 20 --passive spin
  peer write_lat 120 ib_write_lat -s 8 -n 200
  peer read_lat 120 ib_read_lat -s 8 -n 200
  peer atomic_lat 120 ib_atomic_lat -n 200
  peer ucx_put_lat 120 ucx_perftest -t put_lat -s 8 -n 200 -w 20
  peer ucx_get_lat 120 ucx_perftest -t get -D bcopy -s 8 -n 200 -w 20 -O 1
  peer ucx_fadd_lat 120 ucx_perftest -t fadd -n 200 -w 20 -O 1
  # SIZE PERFTEST_ITERS HCOMM_WINDOW HCOMM_WINDOWS: about the same bytes for every tool (4M:
  # twice perftest's, so that hcomm's median is one of 6 windows, not of 3)
  while read -r s n w hn; do
    extra=""
    [ "$s" = 1M ] && extra=",send_recv"
    hcomm "hcomm_bw_$s" 400 -t "put,get$extra" -m bw -s "$s" -w "$w" -n "$hn" --warmup 1
    [ "$s" = 1M ] && HENV="HCOMM_RNDV=get" hcomm "hcomm_sr_get_$s" 400 -t send_recv -m bw -s "$s" -w "$w" -n "$hn" --warmup 1
    b=$(( ${s%[KM]} * $([ "${s: -1}" = K ] && echo 1024 || echo 1048576) ))
    peer "write_bw_$s" 300 ib_write_bw -s "$b" -n "$n"
    peer "read_bw_$s" 300 ib_read_bw -s "$b" -n "$n"
    peer "ucx_put_bw_$s" 300 ucx_perftest -t put_bw -D zcopy -s "$b" -n "$n" -w 2
    peer "ucx_get_bw_$s" 300 ucx_perftest -t get -D zcopy -s "$b" -n "$n" -w 2
  done <<'EOF'
64K 96 16 6
256K 40 8 5
1M 16 4 4
4M 6 2 6
EOF
} > "$cmds"
fi

echo "compare_rdma: host load before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$out/load.txt"
t0=$(date +%s)
rc=0
HCOMM_RDMA_MEM=${HCOMM_RDMA_MEM:-1024M} HCOMM_RDMA_TIMEOUT=${HCOMM_RDMA_TIMEOUT:-1500} HCOMM_RDMA_CMDS="$cmds" \
  HCOMM_RDMA_FILES="$build/tools/hcomm-bench $build/tools/hcomm-probe $base" \
  bash "$root/tests/qemu/run-rdma.sh" "$build" pair > "$out/console.txt" 2>&1 || rc=$?
echo "compare_rdma: run-rdma pair exit $rc after $(( $(date +%s) - t0 ))s; host load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/load.txt"
grep -E '^(FAIL|ok):' "$out/console.txt" | grep -v '^ok' || true

if [ "$rounds" -gt 0 ]; then
PYTHONPATH="$root/bench" python3 - "$out/console.txt" "$rounds" <<'EOF' | tee "$out/table-lat.md"
import json, math, statistics, sys
from rdma_console import read
perf, bench = read(sys.argv[1])
rounds = int(sys.argv[2])
def hc(k, test, run="hcomm_lat"):
    try:
        j = json.loads("\n".join(bench.get("%s_r%d" % (run, k), [])))
    except ValueError:
        return None
    for r in j["results"]:
        if r["test"] == test and r["mode"] == "lat": return r["p50_us"]
    return None
def pt(name):  # perftest lat row: t_typical
    r = perf.get(name)
    return float(r[4]) if r else None
def ucx(name):  # Final: iters typical ...
    r = perf.get(name)
    return float(r[2]) if r and r[0] == "Final:" else None
def ratio(a, b): return None if a is None or b is None or b == 0 else a / b
def num(v): return "-" if v is None else "%.2f" % v
def med(v):
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else None
def ci(v):
    # 95% confidence interval of the median, distribution-free: order
    # statistics k and n+1-k, k the largest with P(Binomial(n, 1/2) < k) <= 2.5%
    # (a sign test; no assumption on how the rounds' ratios spread).
    v = sorted(x for x in v if x is not None)
    n, k, below = len(v), 0, 0.0
    while True:
        below += math.comb(n, k) / 2.0 ** n  # P(X <= k)
        if below > 0.025: break
        k += 1
    return None if k == 0 else (v[k - 1], v[n - k])
def band(v):
    c = ci(v)
    return "%s [%s, %s]" % (num(med(v)), num(c[0]), num(c[1])) if c else num(med(v))
def verdict(v, goal):
    m, c = med(v), ci(v)
    if m is None: return "-"
    if m <= goal: return "met"
    return "MISSED (95%% CI of the median %s %.1f)" % ("includes" if c and c[0] <= goal else "above", goal)
# Like for like: in ib_read_lat / ib_atomic_lat the target process sleeps
# in a socket read; in ucx_perftest's get and fadd it polls its memory (and
# writes to the initiator every millisecond). A halted vCPU takes longer to
# answer in TCG, so the get / fetch_add rows are measured twice: hcomm's
# target waiting in a barrier (it naps: against perftest) and polling a word
# (`--passive spin`: against UCX). Both sides poll in every put ping-pong.
rows = (("put lat (blocking)", "put", "write_lat", "ucx_put_lat", "hcomm_lat", "pu"),
        ("put_nbi lat", "put_nbi", "write_lat", "ucx_put_lat", "hcomm_lat", "pu"),
        ("get lat, target waits", "get", "read_lat", "ucx_get_lat", "hcomm_lat", "p"),
        ("fetch_add lat, target waits", "fetch_add", "atomic_lat", "ucx_fadd_lat", "hcomm_lat", "p"),
        ("get lat, target polls (`--passive spin`)", "get", "read_lat", "ucx_get_lat", "hcomm_lats", "u"),
        ("fetch_add lat, target polls", "fetch_add", "atomic_lat", "ucx_fadd_lat", "hcomm_lats", "u"))
print("8-byte latency: %d interleaved rounds of 1000 iterations in one boot; us per operation, ratios per round" % rounds)
print()
print("| op | hcomm us, rounds | perftest us | UCX us | hcomm/perftest | median [95% CI] | hcomm/UCX | median [95% CI] | goal |")
print("|---|---|---|---|---|---:|---|---:|---|")
for name, t, p, u, run, goals in rows:
    ks = range(1, rounds + 1)
    h = [hc(k, t, run) for k in ks]
    pv = [pt("%s_r%d" % (p, k)) for k in ks]
    uv = [ucx("%s_r%d" % (u, k)) for k in ks]
    rp = [ratio(a, b) for a, b in zip(h, pv)]
    ru = [ratio(a, b) for a, b in zip(h, uv)]
    g = []
    if "p" in goals: g.append("perftest %s" % verdict(rp, 1.1))
    if "u" in goals: g.append("UCX %s" % verdict(ru, 1.0))
    j = lambda v: " / ".join(num(x) for x in v)
    print("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (name, j(h), j(pv), j(uv), j(rp), band(rp), j(ru), band(ru),
                                                             ", ".join(g)))
print()
print("hcomm p50, perftest t_typical, UCX typical (put: half a ping-pong; get, fetch_add: one operation). "
      "Goals: hcomm/perftest <= 1.1, hcomm/UCX <= 1.0 (median of the rounds' paired ratios), each against the "
      "tool whose target does what hcomm's does (perftest's sleeps, ucx_perftest's polls). The interval after a "
      "median is its 95% confidence interval from the rounds' order statistics (none below 6 rounds): a miss whose "
      "interval includes the goal is one this many rounds cannot tell from meeting it.")
if any(k.startswith("hbase_lat_r") for k in bench):
    print()
    print("This build against HCOMM_LAT_BASE, paired by round (target waits in both):")
    print()
    print("| op | this build / base, rounds | median [95% CI] | rounds this build was faster |")
    print("|---|---|---:|---:|")
    for t in ("put", "put_nbi", "get", "fetch_add"):
        r = [ratio(hc(k, t), hc(k, t, "hbase_lat")) for k in range(1, rounds + 1)]
        r = [x for x in r if x is not None]
        print("| %s | %s | %s | %d of %d |" % (t, " / ".join(num(x) for x in r), band(r), sum(x < 1 for x in r),
                                              len(r)))
EOF
exit $rc
fi

PYTHONPATH="$root/bench" python3 - "$out/console.txt" <<'EOF' | tee "$out/table.md"
import json, re, statistics, sys
from rdma_console import read
perf, bench = read(sys.argv[1])
hc, transport, by_name = {}, set(), {}
for name, part in bench.items():
    try:
        j = json.loads("\n".join(part))
    except ValueError as e:
        print("hcomm %s: unreadable JSON (%s)" % (name, e), file=sys.stderr)
        continue
    transport.add(j.get("transport", "?"))
    for r in j["results"]:
        by_name[(name, r["test"], r["mode"], r["bytes"])] = r["p50_us"]
        if not name.startswith(("hcomm_sr_get", "hcomm_lats")):
            hc[(r["test"], r["mode"], r["bytes"])] = r["p50_us"]
MiB = 1048576.0
def pt(name, size):  # perftest: lat rows -> t_typical; bw rows -> size / BW average (MiB/s)
    r = perf.get(name)
    if not r: return None
    if "lat" in name: return float(r[4])
    bw = float(r[3])
    return size / (bw * MiB) * 1e6 if bw > 0 else None
def ucx(name, size):  # Final: iters typical avg overall bw_avg bw_overall mr_avg mr_overall
    r = perf.get(name)
    if not r or r[0] != "Final:": return None
    return float(r[2]) if "lat" in name else float(r[4])
rows = [("put lat (blocking: completion at the target)", 8, hc.get(("put", "lat", 8)), pt("write_lat", 8), ucx("ucx_put_lat", 8), 1.1),
        ("put_nbi lat (like ib_write_lat, ucp_put_lat)", 8, hc.get(("put_nbi", "lat", 8)), pt("write_lat", 8), ucx("ucx_put_lat", 8), 1.1),
        ("get lat (hcomm/UCX: the target polls, as UCX's does)", 8, hc.get(("get", "lat", 8)), pt("read_lat", 8),
         ucx("ucx_get_lat", 8), 1.1, by_name.get(("hcomm_lats", "get", "lat", 8))),
        ("fetch_add lat (hcomm/UCX: the target polls)", 8, hc.get(("fetch_add", "lat", 8)), pt("atomic_lat", 8),
         ucx("ucx_fadd_lat", 8), 1.1, by_name.get(("hcomm_lats", "fetch_add", "lat", 8)))]
for s, b in (("64K", 65536), ("256K", 262144), ("1M", 1 << 20), ("4M", 4 << 20)):
    rows.append(("put bw", b, hc.get(("put", "bw", b)), pt("write_bw_" + s, b), ucx("ucx_put_bw_" + s, b), 1.1))
    rows.append(("get bw", b, hc.get(("get", "bw", b)), pt("read_bw_" + s, b), ucx("ucx_get_bw_" + s, b), 1.1))
def size(b): return "%d M" % (b >> 20) if b >= 1 << 20 else "%d K" % (b >> 10) if b >= 1024 else "%d" % b
def num(v): return "-" if v is None else "%.2f" % v
def ratio(a, b): return None if a is None or b is None or b == 0 else a / b
print("hcomm transport to its peer: %s" % (", ".join(sorted(transport)) or "?"))
print()
print("| op | bytes | hcomm us | perftest us | UCX us | hcomm/perftest | hcomm/UCX | goal |")
print("|---|---:|---:|---:|---:|---:|---:|---|")
verdicts = []
for op, b, h, p, u, lim, *polls in rows:
    # get / fetch_add: hcomm's target naps in a barrier, as perftest's server
    # sleeps (hcomm us, hcomm/perftest); against UCX, whose target polls its
    # memory, the --passive spin run (hcomm/UCX).
    rp, ru = ratio(h, p), ratio(polls[0] if polls else h, u)
    g = []
    if rp is not None: g.append("perftest %s" % ("met" if rp <= lim else "MISSED"))
    if ru is not None: g.append("UCX %s" % ("met" if ru <= 1.0 else "MISSED"))
    print("| %s | %s | %s | %s | %s | %s | %s | %s |" % (op, size(b), num(h), num(p), num(u), num(rp), num(ru), ", ".join(g) or "no data"))
sr, put = hc.get(("send_recv", "bw", 1 << 20)), hc.get(("put", "bw", 1 << 20))
r = ratio(sr, put)
print("| send/recv bw | 1 M | %s | - | - | %s (/ hcomm put) | - | %s |" % (num(sr), num(r), "no data" if r is None else "met" if r <= 1.2 else "MISSED"))
srg = by_name.get(("hcomm_sr_get_1M", "send_recv", "bw", 1 << 20))
print("| send/recv bw, HCOMM_RNDV=get | 1 M | %s | - | - | %s (/ hcomm put) | - | (by READ; for reference) |" % (num(srg), num(ratio(srg, put))))
print()
print("Time per operation, us (lat: medians; bw: hcomm median window / window, perftest and UCX averages). "
      "Goals: hcomm/perftest <= 1.1 (lat, bw), send/recv 1 MiB <= 1.2x hcomm put, hcomm/UCX <= 1.0.")
EOF
exit $rc
