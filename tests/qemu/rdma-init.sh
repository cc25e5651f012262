#!/bin/busybox sh
# /init of the rdma guest (tests/qemu/build-guest.sh BUILD OUT rdma; run by
# tests/qemu/run-rdma.sh). Brings up Soft-RoCE on the virtio NIC and runs the
# command list run-rdma.sh put in /hcomm/rdma-cmds, reporting on the serial
# console, like the qemu-suite guest:
#   HCOMM-RESULT <name> <exit status>   fixed steps modules net rxe gid, then one per command
#   HCOMM-PERF <name> <role> <row>      perftest result rows (hcomm-rdma helper)
#   HCOMM-COUNTER <name> <value>        rxe hw counters and eth0's qdisc, at the end
#   HCOMM-DONE                          then power off
# Kernel parameters (they reach /init as environment variables):
#   hcomm_role=loopback|server|client   which lines of the command list run here
#   hcomm_ip=10.0.0.1/24                eth0's address   hcomm_peer=10.0.0.2  the other guest
#   hcomm_gid=N                         GID index to use instead of the RoCEv2/IPv4 one found
# Command list lines: ROLES NAME TIMEOUT_S COMMAND... (ROLES: comma-separated
# roles or `all`; COMMAND runs under sh -c with HCOMM_ROLE HCOMM_DEV HCOMM_GID
# HCOMM_IP HCOMM_PEER HCOMM_CMD_NAME set, /hcomm first in PATH). busybox sh
# runs its own applets before PATH: iproute2's tc is /usr/sbin/tc, by full path.
/bin/busybox --install -s /bin
export PATH=/hcomm:/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
mkdir -p /dev/shm && mount -t tmpfs shm /dev/shm
exec >/dev/console 2>&1 </dev/null
ulimit -l unlimited

up() { cut -d' ' -f1 /proc/uptime; }
result() { echo "HCOMM-RESULT $1 $2"; echo "hcomm rdma guest: [$(up)s] $1 done"; }
counters() {
  for f in /sys/class/infiniband/rxe0/ports/1/hw_counters/*; do
    [ -f "$f" ] && echo "HCOMM-COUNTER $(basename $f) $(cat $f)"
  done
  if [ -d /sys/class/net/eth0 ]; then
    /usr/sbin/tc -s qdisc show dev eth0
    # "Sent B bytes P pkt (dropped D, overlimits O requeues R)" of the root qdisc
    /usr/sbin/tc -s qdisc show dev eth0 | awk '/^ Sent/ { gsub(/[,()]/, ""); print "HCOMM-COUNTER qdisc_sent_pkts " $4; print "HCOMM-COUNTER qdisc_dropped " $7; exit }'
  fi
}
finish() { counters; echo "HCOMM-DONE"; sync; poweroff -f; }
trap finish EXIT

export HCOMM_ROLE=${hcomm_role:-loopback} HCOMM_DEV=rxe0
ipcidr=${hcomm_ip:-10.0.0.1/24}
export HCOMM_IP=${ipcidr%/*} HCOMM_PEER=${hcomm_peer:-}
echo "hcomm rdma guest: [$(up)s] kernel $(uname -r), $(nproc) CPUs, role $HCOMM_ROLE, $ipcidr, peer ${HCOMM_PEER:-none}"

rc=0
for m in $(cat /lib/modules/order); do insmod /lib/modules/$m || rc=1; done
result modules $rc

ip link set lo up
rc=1
for _ in $(seq 50); do [ -d /sys/class/net/eth0 ] && break; sleep 0.1; done
ip addr add "$ipcidr" dev eth0 && ip link set eth0 up && rc=0
ip -o addr show dev eth0
result net $rc

rdma link add rxe0 type rxe netdev eth0
result rxe $?
rdma link show

# The RoCEv2 GID of eth0's IPv4 address (::ffff:a.b.c.d); the table fills
# asynchronously after the link is added.
port=/sys/class/infiniband/rxe0/ports/1
gid=""
for _ in $(seq 100); do
  for f in $port/gids/*; do
    g=""
    read -r g < $f 2>/dev/null
    case "$g" in 0000:0000:0000:0000:0000:ffff:*) ;; *) continue ;; esac
    i=${f##*/}
    t=""
    read -r t < $port/gid_attrs/types/$i 2>/dev/null
    [ "$t" = "RoCE v2" ] && { gid=$i; break; }
  done
  [ -n "$gid" ] && break
  sleep 0.1
done
echo "hcomm rdma guest: GID table of rxe0 port 1 (index gid type netdev):"
for f in $port/gids/*; do  # rxe has 1024 entries: shell builtins only for the empty ones
  g=""
  read -r g < $f 2>/dev/null
  [ -z "$g" ] || [ "$g" = 0000:0000:0000:0000:0000:0000:0000:0000 ] && continue
  i=${f##*/}
  echo "  $i $g $(cat $port/gid_attrs/types/$i 2>/dev/null) $(cat $port/gid_attrs/ndevs/$i 2>/dev/null)"
done
echo "hcomm rdma guest: RoCEv2 IPv4 GID index ${gid:-none}${hcomm_gid:+, overridden by hcomm_gid=$hcomm_gid}"
[ -n "$gid" ]
result gid $?
export HCOMM_GID=${hcomm_gid:-${gid:-0}}
ibv_devinfo -v -d rxe0 | grep -v -e '^[[:space:]]*$'

while read -r roles name t cmd; do
  case "$roles" in ''|'#'*) continue ;; esac
  case ",$roles," in *,all,*|*,$HCOMM_ROLE,*) ;; *) continue ;; esac
  echo "hcomm rdma guest: [$(up)s] == $name: $cmd"
  HCOMM_CMD_NAME=$name timeout "$t" sh -c "$cmd" </dev/null
  result "$name" $?
done < /hcomm/rdma-cmds
