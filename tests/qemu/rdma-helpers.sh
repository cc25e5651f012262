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
  sout=/tmp/local-server.$$
  "$@" > $sout 2>&1 &
  spid=$!
  HCOMM_CMD_NAME=${HCOMM_CMD_NAME:-cmd} "$0" client 30 "$@" "$HCOMM_IP"
  crc=$?
  wait $spid
  src=$?
  echo "-- server side (exit $src):"
  cat $sout
  [ $crc -ne 0 ] && exit $crc
  exit $src ;;
*)
  echo "hcomm-rdma: unknown command $cmd" >&2
  exit 2 ;;
esac
