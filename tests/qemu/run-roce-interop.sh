#!/usr/bin/env bash
# The `qemu` suite's RoCE interoperation test: hcomm-sim's RoCEv2 engine
# against a RoCE implementation nobody here wrote, Linux's Soft-RoCE (rxe).
#   - hcomm-sim runs as node 0 (one NPU, 10.0.0.1) with its switch's uplink
#     on a QEMU -netdev dgram link (127.0.0.1 UDP);
#   - tests/support/roce_interop_npu drives that NPU through the HAL (HBM, a
#     memory key, an RC queue pair on the device's rings) and sits on the
#     link between the simulator and the guest: it forwards and captures
#     every frame and answers the UDP side channel;
#   - one rdma guest (tests/qemu/run-rdma.sh ... wire) has that link as its NIC,
#     rxe on it, and runs tests/qemu/roce/rxe_interop: RC QPs connected over the
#     UDP side channel; the guest WRITEs, READs (one packet and ten),
#     FETCH_ADDs, CMP_SWAPs and SENDs into the NPU's HBM, then the NPU does
#     the same (and WRITE_WITH_IMM) into the guest's memory; both check
#     every byte;
#   - the capture is read by tshark's InfiniBand dissector (every RoCE frame
#     decodes, none malformed) and scapy recomputes every ICRC, the engine's
#     and rxe's (tests/unit/roce_wire_check.py --capture).
#   tests/qemu/run-roce-interop.sh BUILD_DIR
# HCOMM_ROCE_KEEP=1 keeps the capture and logs (prints where).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$1" && pwd)
npu=$build/tests/roce_interop_npu
guest_bin=$build/tests/rxe_interop
sim=$build/sim/hcomm-sim
for f in "$npu" "$guest_bin" "$sim"; do [ -x "$f" ] || { echo "run-roce-interop: $f not built" >&2; exit 2; }; done
base=/dev/shm
[ -d "$base" ] && [ -w "$base" ] || base=/tmp
run=$(mktemp -d "$base/hcomm-roce-XXXXXX")
npid=""
spid=""
cleanup() {
  [ -n "$npid" ] && kill -9 "$npid" 2>/dev/null || true
  [ -n "$spid" ] && kill "$spid" 2>/dev/null || true
  [ "${HCOMM_ROCE_KEEP:-0}" = 1 ] && echo "run-roce-interop: kept $run" >&2 || rm -rf "$run"
}
trap cleanup EXIT
free_port() {  # a UDP port on 127.0.0.1 nobody has bound
  local p
  while :; do
    p=$((20000 + RANDOM % 40000))
    grep -qi ":$(printf %04X $p) " /proc/net/udp || { echo $p; return; }
  done
}
ports=()
while [ ${#ports[@]} -lt 4 ]; do  # the guest's, the relay's two, the simulator's
  p=$(free_port)
  [[ " ${ports[*]} " == *" $p "* ]] || ports+=("$p")
done
pg=${ports[0]} pn=${ports[1]} pr=${ports[2]} ps=${ports[3]}
mkdir -p "$run/sim"
"$sim" --dir "$run/sim" --devices 1 --node 0 --uplink "$ps:$pr" > "$run/sim.log" 2>&1 &
spid=$!
for _ in $(seq 100); do [ -e "$run/sim/ready" ] && break; sleep 0.1; done
[ -e "$run/sim/ready" ] || { cat "$run/sim.log"; echo "run-roce-interop: hcomm-sim did not start" >&2; exit 1; }
"$npu" --sim-dir "$run/sim" --guest "$pn:$pg" --sim "$pr:$ps" --pcap "$run/wire.pcap" --timeout 300 \
  > "$run/npu.log" 2>&1 &
npid=$!
echo 'client interop 150 rxe_interop $HCOMM_DEV $HCOMM_GID $HCOMM_PEER' > "$run/cmds"
rc=0
HCOMM_RDMA_WIRE="$pg:$pn" HCOMM_RDMA_CMDS="$run/cmds" HCOMM_RDMA_FILES="$guest_bin" HCOMM_RDMA_MEM=512M \
  HCOMM_RDMA_TIMEOUT=${HCOMM_ROCE_TIMEOUT:-240} bash "$here/run-rdma.sh" "$build" wire || rc=1
# The NPU's side exits by itself once the guest said CHECK2 (or at its timeout).
for _ in $(seq 100); do kill -0 "$npid" 2>/dev/null || break; sleep 0.1; done
kill -9 "$npid" 2>/dev/null || true
set +e
wait "$npid"
nrc=$?
set -e
npid=""
kill "$spid" 2>/dev/null || true
wait "$spid" 2>/dev/null || true
spid=""
echo "==== the NPU's side (exit $nrc) ===="
cat "$run/npu.log"
[ "$nrc" = 0 ] || { echo "FAIL: the NPU's side"; cat "$run/sim.log"; rc=1; }
echo "==== the wire ($(stat -c %s "$run/wire.pcap") bytes captured) ===="
if /usr/bin/python3 "$here/../unit/roce_wire_check.py" --capture "$run/wire.pcap"; then
  echo "ok: the capture decodes and every ICRC verifies"
else
  echo "FAIL: the capture"
  rc=1
fi
echo "---- run-roce-interop: $([ $rc = 0 ] && echo ok || echo FAILED) ----"
exit $rc
