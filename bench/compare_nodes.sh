#!/usr/bin/env bash
# compare_nodes.sh: hcomm-bench over the NPU's own RoCE engine between two
# simulated nodes next to the same operations over the intra-node fabric and
# on the host engine, in ONE run, one after the other (never two at once):
#   host      hcomm-run -n 2, HCOMM_ENGINE=host (shared memory)
#   npu       hcomm-run -n 2 --sim: two NPUs of one hcomm-sim (DMA queues, node fabric)
#   npu_roce  two hcomm-sim processes as two nodes (--node 0/1, uplinks joined),
#             rank 0 on node 0, rank 1 on node 1 (HCOMM_HOST_ID): npu_roce
# and prints, per test/mode/size, the median time per operation (us) of
# each and the ratios npu_roce / npu and npu_roce / host (> 1: slower).
#
#   bench/compare_nodes.sh BUILD_DIR [hcomm-bench options]
#     default options: -t put,get,acc,send_recv,fetch_add -s 8,4K,64K,1M --scale 0.3
# Writes BUILD_DIR/compare-nodes/{host,npu,npu_roce}.json and table.md; fails
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

echo "== npu_roce (two simulators, two nodes)" >&2
d0=$(mktemp -d /tmp/hcomm-node0-XXXXXX)
d1=$(mktemp -d /tmp/hcomm-node1-XXXXXX)
p0=$((20000 + RANDOM % 20000))
p1=$((p0 + 1))
"$sim" --dir "$d0" --devices 1 --node 0 --uplink "$p0:$p1" >"$out/sim0.log" 2>&1 &
s0=$!
"$sim" --dir "$d1" --devices 1 --node 1 --uplink "$p1:$p0" >"$out/sim1.log" 2>&1 &
s1=$!
trap 'kill $s0 $s1 2>/dev/null || true; rm -rf "$d0" "$d1"' EXIT
for d in "$d0" "$d1"; do
  for _ in $(seq 100); do [ -e "$d/ready" ] && break; sleep 0.1; done
  [ -e "$d/ready" ] || { echo "compare_nodes: hcomm-sim did not start ($d)" >&2; exit 1; }
done
port=$((40000 + RANDOM % 20000))
pids=()
for r in 0 1; do
  dir=$d0
  [ $r -eq 1 ] && dir=$d1
  o=()
  [ $r -eq 0 ] && o=(--json -o "$out/npu_roce.json")
  RANK=$r LOCAL_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port HCOMM_SOCKET_ADDR=127.0.0.1 \
    HCOMM_ENGINE=npu HCOMM_HOST_ID=node$r HCOMM_SIM_DIR=$dir HCOMM_JOB_ID=compare-nodes-$$ \
    timeout 900 "$bench" "${opts[@]}" "${o[@]}" >"$out/rank$r.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
[ $rc -eq 0 ] || { echo "compare_nodes: the two-node run failed ($rc); see $out/rank*.log" >&2; exit $rc; }

/usr/bin/python3 - "$out" <<'EOF'
import json, sys, os
out = sys.argv[1]
rows = {}
for impl in ("host", "npu", "npu_roce"):
    with open(os.path.join(out, impl + ".json")) as f:
        doc = json.load(f)
    if impl == "npu_roce" and doc.get("transport") != "npu_roce":
        sys.exit("compare_nodes: rank 1 was served by %r, not npu_roce" % doc.get("transport"))
    for r in doc["results"]:
        # p50_us is the median time per operation (bw rows: per operation inside a window)
        rows.setdefault((r["test"], r["mode"], r["bytes"]), {})[impl] = (r["p50_us"], r["mbps"])
lines = ["| test | mode | bytes | host us | npu us | npu_roce us | npu_roce MB/s | npu_roce/npu | npu_roce/host |",
         "|---|---|---|---|---|---|---|---|---|"]
for key in sorted(rows):
    v = rows[key]
    if len(v) < 3:
        continue
    h, n, x = v["host"][0], v["npu"][0], v["npu_roce"][0]
    lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {h:.2f} | {n:.2f} | {x:.2f} | {v['npu_roce'][1]} | "
                 f"{x / n:.2f} | {x / h:.2f} |")
table = "\n".join(lines)
open(os.path.join(out, "table.md"), "w").write(table + "\n")
print(table)
EOF
