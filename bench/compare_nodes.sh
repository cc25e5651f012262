#!/usr/bin/env bash
# compare_nodes.sh: hcomm-bench over the NPU's own RoCE engine between two
# simulated nodes next to the same operations over the intra-node fabric and
# on the host engine, in ONE run, one after the other (never two at once):
#   host      hcomm-run -n 2, HCOMM_ENGINE=host (shared memory)
#   npu       hcomm-run -n 2 --sim: two NPUs of one hcomm-sim (DMA queues, node fabric)
#   npu_roce  two hcomm-sim processes as two nodes (--node 0/1, uplinks joined
#             by UDP on 127.0.0.1), rank 0 on node 0, rank 1 on node 1
#             (HCOMM_HOST_ID): npu_roce
#   npu_roce_memif  the same with DPDK net_memif uplinks (shared-memory
#             rings; when hcomm-sim has DPDK and HCOMM_BENCH_MEMIF is not 0)
# and prints, per test/mode/size, the median time per operation (us) of
# each and the ratios npu_roce* / npu and npu_roce* / host (> 1: slower).
#
#   bench/compare_nodes.sh BUILD_DIR [hcomm-bench options]
#     default options: -t put,get,acc,send_recv,fetch_add -s 8,4K,64K,1M --scale 0.3
# Writes BUILD_DIR/compare-nodes/{host,npu,npu_roce,npu_roce_memif}.json and table.md; fails
# unless the two-node run says rank 1 was served by npu_roce.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { sed -n '2,/^set -e/p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
build=$(cd "$1" && pwd)
shift
opts=("$@")
[ ${#opts[@]} -gt 0 ] || opts=(-t put,get,acc,send_recv,fetch_add -s 8,4K,64K,1M --scale 0.3)
out=$build/compare-nodes
mkdir -p "$out"
bench=$build/tools/hcomm-bench
run=$build/tools/hcomm-run
sim=$build/sim/hcomm-sim
for b in "$bench" "$run" "$sim"; do [ -x "$b" ] || { echo "compare_nodes: $b missing" >&2; exit 2; }; done

echo "== host" >&2
HCOMM_ENGINE=host "$run" -n 2 --timeout 600 -- "$bench" "${opts[@]}" --json -o "$out/host.json"
echo "== npu (one simulator, the node fabric)" >&2
HCOMM_ENGINE=npu HCOMM_SIM_BIN="$sim" "$run" -n 2 --sim --timeout 600 -- "$bench" "${opts[@]}" --json -o "$out/npu.json"

# two_nodes NAME LINK: two simulators joined by LINK (dgram: UDP on
# 127.0.0.1, as QEMU's -netdev dgram; memif: DPDK net_memif, shared-memory
# rings), rank 0 on node 0, rank 1 on node 1; rank 0 writes $out/NAME.json.
two_nodes() {
  local name=$1 link=$2 up0 up1 s0 s1 d0 d1 rc=0 pids=() port
  d0=$(mktemp -d /tmp/hcomm-node0-XXXXXX)
  d1=$(mktemp -d /tmp/hcomm-node1-XXXXXX)
  if [ "$link" = memif ]; then
    up0="dpdk:net_memif0,role=server,socket=/hcomm-bench-$$"
    up1="dpdk:net_memif0,role=client,socket=/hcomm-bench-$$"
  else
    local p0=$((20000 + RANDOM % 20000))
    up0="$p0:$((p0 + 1))"
    up1="$((p0 + 1)):$p0"
  fi
  "$sim" --dir "$d0" --devices 1 --node 0 --uplink "$up0" >"$out/$name-sim0.log" 2>&1 &
  s0=$!
  "$sim" --dir "$d1" --devices 1 --node 1 --uplink "$up1" >"$out/$name-sim1.log" 2>&1 &
  s1=$!
  trap "kill $s0 $s1 2>/dev/null || true; rm -rf '$d0' '$d1'" EXIT
  for d in "$d0" "$d1"; do
    for _ in $(seq 100); do [ -e "$d/ready" ] && break; sleep 0.1; done
    [ -e "$d/ready" ] || { echo "compare_nodes: hcomm-sim did not start ($d; $out/$name-sim*.log)" >&2; exit 1; }
  done
  if [ "$link" = memif ]; then  # the link comes up a moment after both ends exist
    /usr/bin/python3 - "$d0" "$d1" <<'PY' || { echo "compare_nodes: the memif link did not come up" >&2; exit 1; }
import socket, sys, time
until = time.time() + 10
for d in sys.argv[1:]:
    while True:
        reply = ""
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(d + "/control.sock")
                s.sendall(b"net stats\n")
                reply = s.makefile().readline()
        except OSError:
            pass
        if ",link-up)" in reply:
            break
        if time.time() > until:
            sys.exit(1)
        time.sleep(0.02)
PY
  fi
  port=$((40000 + RANDOM % 20000))
  for r in 0 1; do
    local dir=$d0 o=()
    [ $r -eq 1 ] && dir=$d1
    [ $r -eq 0 ] && o=(--json -o "$out/$name.json")
    RANK=$r LOCAL_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port HCOMM_SOCKET_ADDR=127.0.0.1 \
      HCOMM_ENGINE=npu HCOMM_HOST_ID=node$r HCOMM_SIM_DIR=$dir HCOMM_JOB_ID=compare-nodes-$$-$name \
      timeout 900 "$bench" "${opts[@]}" "${o[@]}" >"$out/$name-rank$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  kill $s0 $s1 2>/dev/null || true
  wait $s0 $s1 2>/dev/null || true
  rm -rf "$d0" "$d1"
  trap - EXIT
  [ $rc -eq 0 ] || { echo "compare_nodes: the two-node run over $link failed ($rc); see $out/$name-rank*.log" >&2; exit $rc; }
}

echo "== npu_roce (two simulators, two nodes, UDP uplinks)" >&2
two_nodes npu_roce dgram
impls="host npu npu_roce"
if grep -q "uplink dpdk:DEVARGS " <("$sim" --help 2>&1) && [ "${HCOMM_BENCH_MEMIF:-1}" != 0 ]; then
  echo "== npu_roce (two simulators, two nodes, DPDK memif uplinks)" >&2
  two_nodes npu_roce_memif memif
  impls="$impls npu_roce_memif"
fi

/usr/bin/python3 - "$out" $impls <<'EOF'
import json, sys, os
out, impls = sys.argv[1], sys.argv[2:]
rows = {}
for impl in impls:
    with open(os.path.join(out, impl + ".json")) as f:
        doc = json.load(f)
    if impl.startswith("npu_roce") and doc.get("transport") != "npu_roce":
        sys.exit("compare_nodes: rank 1 was served by %r, not npu_roce (%s)" % (doc.get("transport"), impl))
    for r in doc["results"]:
        # p50_us is the median time per operation (bw rows: per operation inside a window)
        rows.setdefault((r["test"], r["mode"], r["bytes"]), {})[impl] = (r["p50_us"], r["mbps"])
roce = [i for i in impls if i.startswith("npu_roce")]
head = "| test | mode | bytes | host us | npu us | " + " | ".join(f"{i} us | {i} MB/s | {i}/npu | {i}/host" for i in roce) + " |"
lines = [head, "|" + "---|" * (5 + 4 * len(roce))]
for key in sorted(rows):
    v = rows[key]
    if len(v) < len(impls):
        continue
    h, n = v["host"][0], v["npu"][0]
    cells = [f"{key[0]}", f"{key[1]}", f"{key[2]}", f"{h:.2f}", f"{n:.2f}"]
    for i in roce:
        x = v[i][0]
        cells += [f"{x:.2f}", f"{v[i][1]}", f"{x / n:.2f}", f"{x / h:.2f}"]
    lines.append("| " + " | ".join(cells) + " |")
table = "\n".join(lines)
open(os.path.join(out, "table.md"), "w").write(table + "\n")
print(table)
EOF
