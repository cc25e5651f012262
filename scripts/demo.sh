#!/usr/bin/env bash
# Sets everything up and runs the demo: on the simulator unless a real hcomm
# NPU is bound to vfio-pci on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh
B=${BUILD_DIR:-build}
probe="$B/tools/hcomm-probe"
sim_pid=""
cleanup() { [ -n "$sim_pid" ] && kill "$sim_pid" 2>/dev/null && wait "$sim_pid" 2>/dev/null; true; }
trap cleanup EXIT
devices=()
for d in /sys/bus/pci/devices/*; do
  [ -e "$d/vendor" ] || continue
  if [ "$(cat "$d/vendor")" = 0x1dea ] && [ "$(cat "$d/device")" = 0x0001 ] &&
     [ "$(basename "$(readlink -f "$d/driver" 2>/dev/null)")" = vfio-pci ]; then
    devices+=("$(basename "$d")")
  fi
done
if [ ${#devices[@]} -eq 0 ]; then
  export HCOMM_SIM_DIR=$(mktemp -d /tmp/hcomm-demo-XXXXXX)
  echo "== no NPU bound to vfio-pci: starting hcomm-sim (2 devices) in $HCOMM_SIM_DIR"
  "$B/sim/hcomm-sim" --devices 2 --hbm 256M --dir "$HCOMM_SIM_DIR" &
  sim_pid=$!
  for _ in $(seq 100); do [ -e "$HCOMM_SIM_DIR/ready" ] && break; sleep 0.1; done
  [ -e "$HCOMM_SIM_DIR/ready" ] || { echo "hcomm-sim did not start"; exit 1; }
  devices=(sim:0 sim:1)
fi
echo "== hcomm-probe list"
"$probe" list
for d in "${devices[@]}"; do
  echo "== hcomm-probe info $d"
  "$probe" info "$d"
  echo "== hcomm-probe selftest $d"
  "$probe" selftest "$d"
done
# The examples, each on a simulator of its own (hcomm-run --sim), then on the host engine.
run="$B/tools/hcomm-run"
ex="$B/examples"
npu() {
  local n=$1 prog=$2
  shift 2
  echo "== HCOMM_ENGINE=npu hcomm-run --sim -n $n $prog${*:+ $*}"
  HCOMM_ENGINE=npu "$run" --sim -n "$n" --timeout 60 "$ex/$prog" "$@"
}
npu 2 point_to_point
npu 2 put_get
npu 3 parameter_server
npu 3 pipeline
npu 3 pipeline --notify
echo "== HCOMM_ENGINE=host hcomm-run -n 2 point_to_point"
HCOMM_ENGINE=host "$run" -n 2 --timeout 60 "$ex/point_to_point"
echo "== demo done"
