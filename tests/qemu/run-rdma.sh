#!/usr/bin/env bash
# Soft-RoCE (rxe) in QEMU guests: the test bed of the verbs transport, proven
# with perftest. Guests are Debian's kernel + a busybox initramfs with rdma-core,
# perftest and UCX from Debian packages (tests/qemu/build-guest.sh BUILD OUT rdma)
# and tests/qemu/rdma-init.sh as /init; QEMU runs unprivileged (TCG).
#
#   tests/qemu/run-rdma.sh BUILD_DIR loopback      one guest, 2 vCPUs: perftest client
#                                                  and server on the same rxe0
#   tests/qemu/run-rdma.sh BUILD_DIR pair [netem]  two guests (1 vCPU each) joined by
#       -netdev dgram over 127.0.0.1 UDP: guest A (server, 10.0.0.1) and guest B
#       (client, 10.0.0.2) run ib_{write,read,atomic}_lat (8 B x200), ib_{write,read}_bw
#       (64 KiB x100, 1 MiB x20) and ucx_perftest on UCT rc_verbs (am_lat, put_bw). netem:
#       a lighter list (writes 64 KiB x10 only, no put_bw), and guest B's eth0 gets
#       `tc qdisc ... netem loss 5% delay 1ms reorder 25% 50%` first; the run then
#       also requires that netem dropped packets (tc -s qdisc), that rxe
#       retransmitted (hw counter completer_retry_err) and that rxe's responder
#       saw PSN gaps (out_of_seq_request), counters summed over both guests. Under
#       TCG rxe retransmits on timeouts now and then without any loss; the PSN
#       gaps are what netem adds (0-4 without it, ~100 with it).
#   tests/qemu/run-rdma.sh BUILD_DIR all           loopback, pair, pair netem in turn
#   tests/qemu/run-rdma.sh BUILD_DIR wire          one guest (client, 10.0.0.2, peer 10.0.0.1)
#       whose NIC is a -netdev dgram link to a program on this host:
#       HCOMM_RDMA_WIRE=GUEST_PORT:PEER_PORT (127.0.0.1 UDP; the peer binds
#       PEER_PORT and sends to GUEST_PORT), e.g. hcomm-sim's RoCEv2 engine
#       (tests/qemu/run-roce-interop.sh). Needs HCOMM_RDMA_CMDS.
#
# Exit status 0 only when every guest reported HCOMM-DONE and every expected
# HCOMM-RESULT is 0 (fixed steps modules, net, rxe, gid, then one per command);
# a missing result, a QEMU failure or the time bound failing any guest fails
# the run. Prints each console, the perftest rows (HCOMM-PERF) and counters.
#
# Running other programs in the guests (the hook for the verbs conformance
# binary): HCOMM_RDMA_CMDS=FILE replaces the built-in perftest list. Each line:
#     ROLES NAME TIMEOUT_S COMMAND...
# ROLES is comma-separated (loopback, server, client) or `all`; COMMAND runs
# under `sh -c` in every guest of a matching role, bounded by TIMEOUT_S, and is
# reported as `HCOMM-RESULT NAME <status>`; the runner expects every NAME from
# every matching guest. A guest powers off when its own list is done, so a
# server-side line has to wait for its client (as perftest servers do). In COMMAND: $HCOMM_DEV (rxe0), $HCOMM_GID (the RoCEv2
# IPv4 GID index found by scanning the table), $HCOMM_IP (this guest),
# $HCOMM_PEER (the other guest), $HCOMM_ROLE; `hcomm-rdma client SECS CMD...`
# reruns a client until its server (in the other guest) accepts,
# `hcomm-rdma local CMD...` runs CMD as server and client in one guest
# (tests/qemu/rdma-helpers.sh). HCOMM_RDMA_FILES="PATH..." puts those files in
# the guests' /hcomm (first in PATH), with the shared libraries ldd finds for
# them on this host except the ones the image already has; they travel in a
# second cpio appended to the cached initramfs, so the image is not rebuilt.
# Example:
#     server verbs 120 verbs_conformance --gtest_color=no --peer=$HCOMM_PEER
#     client verbs 120 verbs_conformance --gtest_color=no --peer=$HCOMM_PEER
#
# Environment: HCOMM_RDMA_TIMEOUT (s, per run, default 200) bounds each guest;
# HCOMM_RDMA_GRACE (s, default 30): once one guest of a pair is gone, how long
# the other may still run; HCOMM_QEMU_APPEND adds kernel parameters
# (hcomm_gid=N overrides the GID index); HCOMM_QEMU_ARGS adds QEMU options;
# HCOMM_QEMU_CACHE (default BUILD_DIR/qemu-guest/cache, shared with the qemu
# suite) caches the kernel and .debs; HCOMM_RDMA_GUEST (default
# BUILD_DIR/qemu-rdma-guest) receives the kernel and initramfs;
# HCOMM_RDMA_KEEP=1 keeps the run directory (/dev/shm/hcomm-rdma-*).
# Needs qemu-system-x86, busybox-static, cpio, xz-utils (scripts/deps.sh); no root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 2 ] || { sed -n '2,/^set -e/p' "$0" | sed 's/^# \{0,1\}//' | head -20 >&2; exit 2; }
build=$(cd "$1" && pwd)
mode=$2
opt=${3:-}
guest=${HCOMM_RDMA_GUEST:-$build/qemu-rdma-guest}
export HCOMM_QEMU_CACHE=${HCOMM_QEMU_CACHE:-$build/qemu-guest/cache}
case "$mode/$opt" in
  loopback/|pair/|pair/netem|wire/) ;;
  all/)
    fail=0
    t0=$(date +%s)
    bash "$here/build-guest.sh" "$build" "$guest" rdma || exit 2
    export HCOMM_RDMA_BUILT=1  # once for the three runs
    for m in loopback pair "pair netem"; do
      s=$(date +%s)
      # shellcheck disable=SC2086
      bash "$0" "$build" $m || { echo "run-rdma: $m FAILED"; fail=1; }
      echo "run-rdma: == $m: $(( $(date +%s) - s ))s"
    done
    echo "run-rdma: all modes: $(( $(date +%s) - t0 ))s, $([ $fail -eq 0 ] && echo ok || echo FAILED)"
    exit $fail ;;
  *) echo "run-rdma: mode is loopback, pair, pair netem, wire or all (got '$mode $opt')" >&2; exit 2 ;;
esac
command -v qemu-system-x86_64 >/dev/null || { echo "run-rdma: qemu-system-x86_64 missing (scripts/deps.sh)" >&2; exit 2; }
limit=${HCOMM_RDMA_TIMEOUT:-200}
grace=${HCOMM_RDMA_GRACE:-30}

t_start=$(date +%s)
[ "${HCOMM_RDMA_BUILT:-0}" = 1 ] || bash "$here/build-guest.sh" "$build" "$guest" rdma
t_built=$(date +%s)

base=/dev/shm
[ -d "$base" ] && [ -w "$base" ] || base=/tmp
run=$(mktemp -d "$base/hcomm-rdma-XXXXXX")
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  [ "${HCOMM_RDMA_KEEP:-0}" = 1 ] && echo "run-rdma: kept $run" >&2 || rm -rf "$run"
}
trap cleanup EXIT

# ---- the command list ----
cmds="$run/rdma-cmds"
# netem goes first on guest B, whichever list follows.
netem="client netem 10 /usr/sbin/tc qdisc add dev eth0 root netem loss 5% delay 1ms reorder 25% 50%"
if [ -n "${HCOMM_RDMA_CMDS:-}" ]; then
  { [ "$opt" = netem ] && echo "$netem"; cat "$HCOMM_RDMA_CMDS"; } > "$cmds"
elif [ "$mode" = loopback ]; then
  # shellcheck disable=SC2016  # expanded in the guest
  cat > "$cmds" <<'EOF'
loopback binaries 60 hcomm-rdma check-binaries
loopback write_lat 60 hcomm-rdma local ib_write_lat -d $HCOMM_DEV -x $HCOMM_GID -F -p 18515 -s 8 -n 200
loopback write_bw_64k 60 hcomm-rdma local ib_write_bw -d $HCOMM_DEV -x $HCOMM_GID -F -p 18516 -s 65536 -n 100
loopback ucx_am_lat 60 UCX_IB_GID_INDEX=$HCOMM_GID hcomm-rdma local ucx_perftest -d $HCOMM_DEV:1 -x rc_verbs -t am_lat -s 8 -n 200 -p 18517
EOF
else
  {
    echo "client ping 60 ping -c 1 -w 60 \$HCOMM_PEER"
    [ "$opt" = netem ] && echo "$netem"
    port=18515
    # NAME TOOL ARGS: the server runs TOOL ARGS, the client TOOL ARGS $HCOMM_PEER
    # perftest: the server runs TOOL ARGS, the client TOOL ARGS $HCOMM_PEER.
    # ucx_perftest at the UCT level (rc_verbs itself): UCP with
    # UCX_TLS=rc_verbs finds no wireup transport, and with ud_verbs added its
    # UD endpoints time out on rxe. Under netem, RC's go-back-N makes 5% loss
    # costly (64 KiB writes: ~0.15 MB/s, 1 MiB writes do not finish in 90 s),
    # so the write bandwidth runs are smaller there.
    while read -r name tool args; do
      [ -n "$name" ] || continue
      case $tool in
        ucx_perftest) env="UCX_IB_GID_INDEX=\$HCOMM_GID " pt="$tool -d \$HCOMM_DEV:1 -x rc_verbs -p $port $args" ;;
        *) env="" pt="$tool -d \$HCOMM_DEV -x \$HCOMM_GID -F -p $port $args" ;;
      esac
      echo "server $name 90 ${env}hcomm-rdma server $pt"
      echo "client $name 90 ${env}hcomm-rdma client 60 $pt \$HCOMM_PEER"
      port=$((port + 1))
    done < <(if [ "$opt" = netem ]; then cat <<'EOF'
write_lat ib_write_lat -s 8 -n 200
read_lat ib_read_lat -s 8 -n 200
atomic_lat ib_atomic_lat -n 200
write_bw_64k ib_write_bw -s 65536 -n 10
read_bw_64k ib_read_bw -s 65536 -n 100
read_bw_1m ib_read_bw -s 1048576 -n 20
ucx_am_lat ucx_perftest -t am_lat -s 8 -n 200
EOF
    else cat <<'EOF'
write_lat ib_write_lat -s 8 -n 200
read_lat ib_read_lat -s 8 -n 200
atomic_lat ib_atomic_lat -n 200
write_bw_64k ib_write_bw -s 65536 -n 100
write_bw_1m ib_write_bw -s 1048576 -n 20
read_bw_64k ib_read_bw -s 65536 -n 100
read_bw_1m ib_read_bw -s 1048576 -n 20
ucx_am_lat ucx_perftest -t am_lat -s 8 -n 200
ucx_put_bw ucx_perftest -t put_bw -D zcopy -s 65536 -n 100
EOF
    fi)
  } > "$cmds"
fi

# ---- the per-run overlay: command list and extra files, a second cpio ----
ovl="$run/overlay"
mkdir -p "$ovl/hcomm"
cp "$cmds" "$ovl/hcomm/rdma-cmds"
for f in ${HCOMM_RDMA_FILES:-}; do
  [ -f "$f" ] || { echo "run-rdma: HCOMM_RDMA_FILES: $f missing" >&2; exit 2; }
  cp "$f" "$ovl/hcomm/"
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | while read -r lib; do
    n=$(basename "$lib")
    grep -q "/$n\$" "$guest/initramfs-rdma.list" && continue
    mkdir -p "$ovl/usr/lib/x86_64-linux-gnu"
    cp -L "$lib" "$ovl/usr/lib/x86_64-linux-gnu/$n"
  done
done
(cd "$ovl" && find . -print0 | cpio --null -o -H newc --quiet) > "$run/overlay.cpio"
cat "$guest/initramfs-rdma.cpio" "$run/overlay.cpio" > "$run/initrd.cpio"

# ---- guests ----
# start NAME ROLE SMP IP PEER NETDEV
start() {
  local name=$1 role=$2 smp=$3 ip=$4 peer=$5 netdev=$6 host=${4%/*}
  host=${host##*.}
  # shellcheck disable=SC2086
  timeout -k 5 "$limit" qemu-system-x86_64 -nodefaults -no-user-config \
    -machine q35 -accel tcg -cpu max -smp "$smp" -m "${HCOMM_RDMA_MEM:-512M}" \
    -kernel "$guest/vmlinux" -initrd "$run/initrd.cpio" \
    -append "console=ttyS0 panic=-1 oops=panic quiet loglevel=4 hcomm_role=$role hcomm_ip=$ip hcomm_peer=$peer ${HCOMM_QEMU_APPEND:-}" \
    -netdev "$netdev" -device "virtio-net-pci,netdev=n0,mac=52:54:00:12:34:$(printf %02x "$host")" \
    -display none -serial file:"$run/$name.log" -pidfile "$run/$name.pid" -no-reboot ${HCOMM_QEMU_ARGS:-} &
  pids+=($!)
  names+=("$name")
  roles+=("$role")
}
free_port() {  # a UDP port on 127.0.0.1 nobody has bound (/proc/net/udp lists them in hex)
  local p
  while :; do
    p=$((20000 + RANDOM % 40000))
    grep -qi ":$(printf %04X $p) " /proc/net/udp || { echo $p; return; }
  done
}
names=() roles=()
t_boot=$(date +%s)
if [ "$mode" = loopback ]; then
  start loopback loopback 2 10.0.0.1/24 "" "user,id=n0,restrict=on"
elif [ "$mode" = wire ]; then
  case "${HCOMM_RDMA_WIRE:-}" in
    *:*) ;;
    *) echo "run-rdma: wire mode needs HCOMM_RDMA_WIRE=GUEST_PORT:PEER_PORT" >&2; exit 2 ;;
  esac
  [ -n "${HCOMM_RDMA_CMDS:-}" ] || { echo "run-rdma: wire mode needs HCOMM_RDMA_CMDS" >&2; exit 2; }
  start client client 1 10.0.0.2/24 10.0.0.1 \
    "dgram,id=n0,local.type=inet,local.host=127.0.0.1,local.port=${HCOMM_RDMA_WIRE%%:*},remote.type=inet,remote.host=127.0.0.1,remote.port=${HCOMM_RDMA_WIRE##*:}"
else
  pa=$(free_port)
  pb=$(free_port)
  while [ "$pb" = "$pa" ]; do pb=$(free_port); done
  dg="dgram,id=n0,local.type=inet,local.host=127.0.0.1,remote.type=inet,remote.host=127.0.0.1"
  start server server 1 10.0.0.1/24 10.0.0.2 "$dg,local.port=$pa,remote.port=$pb"
  start client client 1 10.0.0.2/24 10.0.0.1 "$dg,local.port=$pb,remote.port=$pa"
fi

# Wait for all; once one is gone the others get $grace seconds.
declare -A qrc=()
left=${#pids[@]}
deadline=""
while [ $left -gt 0 ]; do
  for i in "${!pids[@]}"; do
    p=${pids[$i]}
    [ -n "${qrc[$i]:-}" ] && continue
    if ! kill -0 "$p" 2>/dev/null; then
      set +e; wait "$p"; qrc[$i]=$?; set -e
      left=$((left - 1))
      echo "run-rdma: guest ${names[$i]} exited (status ${qrc[$i]}) after $(( $(date +%s) - t_boot ))s"
      [ -n "$deadline" ] || deadline=$(( $(date +%s) + grace ))
    fi
  done
  if [ $left -gt 0 ] && [ -n "$deadline" ] && [ "$(date +%s)" -ge "$deadline" ]; then
    for i in "${!pids[@]}"; do
      [ -n "${qrc[$i]:-}" ] && continue
      echo "run-rdma: guest ${names[$i]} still running ${grace}s after the other one exited: killed"
      kill -9 "${pids[$i]}" 2>/dev/null || true
    done
    deadline=$(( $(date +%s) + 3600 ))
  fi
  [ $left -gt 0 ] && sleep 0.2
done
pids=()
t_end=$(date +%s)

fail=0
failed() { echo "FAIL: $*"; fail=1; }
declare -A counter=()
for i in "${!names[@]}"; do
  name=${names[$i]} role=${roles[$i]}
  tr -d '\r' < "$run/$name.log" > "$run/$name.txt"
  echo "==== guest $name ($role) console ===="
  cat "$run/$name.txt"
  case ${qrc[$i]} in
    0) ;;
    124) failed "$name: guest did not finish within ${limit}s" ;;
    137) failed "$name: guest killed (its peer was gone for ${grace}s, or from outside)" ;;
    *) failed "$name: qemu exited with status ${qrc[$i]}" ;;
  esac
  grep -q '^HCOMM-DONE' "$run/$name.txt" || failed "$name: guest did not report HCOMM-DONE"
  expect="modules net rxe gid $(awk -v r="$role" '$1 !~ /^#/ && NF >= 4 {
      n = split($1, rs, ","); for (k = 1; k <= n; k++) if (rs[k] == r || rs[k] == "all") { print $2; break } }' "$cmds")"
  for check in $expect; do
    line=$(grep "^HCOMM-RESULT $check " "$run/$name.txt" | tail -1 || true)
    if [ -z "$line" ]; then failed "$name: $check: no result"
    elif [ "${line##* }" != 0 ]; then failed "$name: $check: exit ${line##* }"
    else echo "ok: $name: $check"
    fi
  done
  while read -r _ c v; do counter[$name.$c]=$v; done < <(grep '^HCOMM-COUNTER ' "$run/$name.txt" || true)
done

echo "==== perftest (TCG: compare ratios only) ===="
cat "$run"/*.txt | awk '/^HCOMM-PERF / && $3 == "client" {
    n = $2; sub(/^HCOMM-PERF [^ ]+ [^ ]+ /, "")
    if ($1 == "Final:") printf "  %-14s ucx_perftest: %s\n", n, $0
    else if (n ~ /lat/) printf "  %-14s %8d B x%-5d t_typical %9.2f us  t_avg %9.2f us  t_max %9.2f us\n", n, $1, $2, $5, $6, $4
    else printf "  %-14s %8d B x%-5d BW avg %9.2f MB/s  peak %9.2f MB/s  %.4f Mpps\n", n, $1, $2, $4, $3, $5
  }'
echo "==== rxe counters ===="
for k in $(printf '%s\n' "${!counter[@]}" | sort); do
  [ "${counter[$k]}" != 0 ] && echo "  $k ${counter[$k]}"
done
if [ "$opt" = netem ]; then
  dropped=${counter[client.qdisc_dropped]:-0}
  retries=$(( ${counter[client.completer_retry_err]:-0} + ${counter[server.completer_retry_err]:-0} ))
  [ "$dropped" -gt 0 ] && echo "ok: netem dropped $dropped packets" || failed "netem dropped no packet"
  [ "$retries" -gt 0 ] && echo "ok: rxe retransmitted (completer_retry_err $retries)" || failed "rxe never retransmitted (completer_retry_err 0)"
  # Under TCG rxe also retransmits on timeouts without any loss; the
  # responder seeing PSN gaps (and the requester the NAKs) is netem's doing.
  gaps=$(( ${counter[server.out_of_seq_request]:-0} + ${counter[client.out_of_seq_request]:-0} ))
  naks=$(( ${counter[server.rcvd_seq_err]:-0} + ${counter[client.rcvd_seq_err]:-0} ))
  [ "$gaps" -gt 0 ] && echo "ok: rxe saw PSN gaps (out_of_seq_request $gaps, sequence NAKs received $naks)" || failed "rxe saw no PSN gap (out_of_seq_request 0)"
fi
echo "---- run-rdma $mode${opt:+ $opt}: guest build $((t_built - t_start))s, guests $((t_end - t_boot))s, total $((t_end - t_start))s: $([ $fail -eq 0 ] && echo ok || echo FAILED) ----"
exit $fail
