#!/bin/busybox sh
# /hcomm/hcomm-rdma in the rdma guest (tests/qemu/build-guest.sh ... rdma):
# helpers for the command lists run-rdma.sh hands to the guests.
#
#   hcomm-rdma client SECONDS CMD...  run a client whose server may not be
#       listening yet (the other guest boots at its own pace): rerun it while
#       it fails to connect, for at most SECONDS; then report its status.
#   hcomm-rdma local CMD...           server and client in this guest: CMD in
#       the background, then `CMD $HCOMM_IP` as the client (loopback).
#   hcomm-rdma server CMD...          CMD, output kept and parsed like the others.
#   hcomm-rdma check-binaries         every program and dlopen'd module of the image
#       loads (ld.so --list) and every tool starts.
#
# Every perftest / ucx_perftest result row is repeated as
#   HCOMM-PERF <name> <role> <row>
# (name: $HCOMM_CMD_NAME) so the host can tabulate it.
perf_rows() {  # perf_rows ROLE FILE
  awk -v n="${HCOMM_CMD_NAME:-cmd}" -v r="$1" '
    /^ *#bytes/ { hdr = 1; next }
    hdr && /^ *[0-9]+ +[0-9]+ / { print "HCOMM-PERF " n " " r " " $0; hdr = 0 }
    /^Final:/ { print "HCOMM-PERF " n " " r " " $0 }  # ucx_perftest summary row
  ' "$2"
}
refused() { grep -q -e "Couldn't connect" -e 'Connection refused' -e 'No route to host' "$1"; }

# Benchmarks busy-poll; at nice 19 the kernel threads rxe defers work to
# (ksoftirqd, kworkers) preempt them at once instead of at the next tick.
# (busybox has renice, not nice; what this shell starts inherits it.)
renice -n "${HCOMM_RDMA_NICE:-19}" -p $$ >/dev/null
cmd=$1
shift
case "$cmd" in
client)
  limit=$1
  shift
  end=$(( $(date +%s) + limit ))
  out=/tmp/client.$$
  while :; do
    "$@" > $out 2>&1
    rc=$?
    [ $rc -ne 0 ] && refused $out && [ "$(date +%s)" -lt $end ] && { sleep 0.5; continue; }
    break
  done
  cat $out
  perf_rows client $out
  exit $rc ;;
server)
  out=/tmp/server.$$
  "$@" > $out 2>&1
  rc=$?
  cat $out
  perf_rows server $out
  exit $rc ;;
local)
  # Server and client on CPUs of their own when there are two: two busy
  # pollers sharing one vCPU measure the scheduler tick (4 ms), not rxe.
  pin0="" pin1=""
  [ "$(nproc)" -ge 2 ] && pin0="taskset -c 0" pin1="taskset -c 1"
  sout=/tmp/local-server.$$
  $pin0 "$@" > $sout 2>&1 &
  spid=$!
  HCOMM_CMD_NAME=${HCOMM_CMD_NAME:-cmd} $pin1 "$0" client 30 "$@" "$HCOMM_IP"
  crc=$?
  wait $spid
  src=$?
  echo "-- server side (exit $src):"
  cat $sout
  [ $crc -ne 0 ] && exit $crc
  exit $src ;;
check-binaries)  # every program and dlopen'd module loads; every tool starts
  rc=0
  for f in /usr/bin/* /usr/sbin/* /usr/lib/x86_64-linux-gnu/libibverbs/*.so /usr/lib/x86_64-linux-gnu/ucx/*.so.0; do
    if out=$(/usr/lib64/ld-linux-x86-64.so.2 --list "$f" 2>&1) && ! echo "$out" | grep -q 'not found'; then
      echo "loads: $f"
    else
      echo "DOES NOT LOAD: $f"; echo "$out"; rc=1
    fi
  done
  for b in /usr/bin/ib_*_lat /usr/bin/ib_*_bw; do
    v=$($b --version 2>&1)
    case "$v" in *[Vv]ersion*) echo "runs: $b: $v" ;; *) echo "DOES NOT RUN: $b: $v"; rc=1 ;; esac
  done
  v=$(timeout 10 ucx_perftest -h 2>&1)
  case "$v" in *Usage*) echo "runs: ucx_perftest -h: $(echo "$v" | head -1)" ;; *) echo "DOES NOT RUN: ucx_perftest -h: $v"; rc=1 ;; esac
  for c in "rdma -V" "/usr/sbin/tc -V" "ucx_info -v" "ibv_devices" "ibv_devinfo -l"; do
    if v=$($c 2>&1); then echo "runs: $c: $(echo "$v" | head -2 | tr '\n' ' ')"; else echo "DOES NOT RUN: $c: $v"; rc=1; fi
  done
  exit $rc ;;
*)
  echo "hcomm-rdma: unknown command $cmd" >&2
  exit 2 ;;
esac
