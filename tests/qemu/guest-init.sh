#!/bin/busybox sh
# /init of the qemu-suite guest (tests/qemu/build-guest.sh puts it there).
# Binds every ivshmem function to vfio-pci through driver_override, runs the
# checks through the real VFIO driver and reports each result on the serial
# console as "HCOMM-RESULT <name> <exit status>", then "HCOMM-DONE" and powers
# off. The host side (tests/qemu/run-guest.sh) reads that and decides.
/bin/busybox --install -s /bin
export PATH=/bin:/sbin:/hcomm
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
mkdir -p /dev/shm && mount -t tmpfs shm /dev/shm
exec >/dev/console 2>&1
ip link set lo up  # the API's bootstrap rendezvous is on 127.0.0.1

result() { echo "HCOMM-RESULT $1 $2"; }
finish() { echo "HCOMM-DONE"; sync; poweroff -f; }
trap finish EXIT

echo "hcomm guest: kernel $(uname -r), $(nproc) CPUs, $(grep MemTotal /proc/meminfo)"
# Hugepages for iova-mode=pa DMA buffers (physically contiguous).
echo "${HCOMM_HUGEPAGES:-192}" > /proc/sys/vm/nr_hugepages
echo "hcomm guest: $(cat /proc/sys/vm/nr_hugepages) hugepages"

rc=0
for m in irqbypass vfio vfio_iommu_type1 vfio_virqfd vfio-pci-core vfio-pci; do
  insmod /lib/modules/$m.ko* || rc=1
done
result modules $rc

devs=""
for d in /sys/bus/pci/devices/*; do
  [ "$(cat $d/vendor)" = 0x1af4 ] && [ "$(cat $d/device)" = 0x1110 ] || continue
  a=$(basename $d)
  echo vfio-pci > $d/driver_override
  [ -e $d/driver ] && echo $a > $d/driver/unbind
  echo $a > /sys/bus/pci/drivers_probe
  devs="$devs $a"
done
set -- $devs
bound=0
for a in "$@"; do [ "$(basename $(readlink /sys/bus/pci/devices/$a/driver))" = vfio-pci ] && bound=$((bound + 1)); done
echo "hcomm guest: ivshmem functions:$devs ($bound bound to vfio-pci); /dev/vfio: $(ls /dev/vfio | tr '\n' ' ')"
[ $# -ge 2 ] && [ $bound -eq $# ]
result bind $?
ulimit -l unlimited

run() {  # run NAME TIMEOUT_S CMD...: bounded, reported
  name=$1 t=$2
  shift 2
  echo "hcomm guest: == $name: $*"
  timeout "$t" "$@"
  result "$name" $?
}
gtest() {  # gtest NAME TIMEOUT_S CMD...: as run, and a filter that matched nothing fails
  name=$1 t=$2
  shift 2
  echo "hcomm guest: == $name: $*"
  timeout "$t" "$@" > /tmp/$name.out 2>&1
  rc=$?
  cat /tmp/$name.out
  [ $rc -eq 0 ] && ! grep -q '^\[  PASSED  \] [1-9]' /tmp/$name.out && { echo "hcomm guest: $name ran no test"; rc=99; }
  result "$name" $rc
}
# Per-check bounds add up to less than the host's bound (run-guest.sh).
run probe-list 30 hcomm-probe list
run probe-info 30 hcomm-probe info "$1"
run probe-selftest 60 hcomm-probe selftest "$1"
run probe-selftest-1 60 hcomm-probe selftest "$2"
# Bad descriptors get error completions through the VFIO path (also part of
# the whole suite below; reported on its own so a failure names it).
HCOMM_TEST_DEVICES="$1,$2" gtest bad-descriptors 60 integration_npu_dma --gtest_color=no \
  --gtest_filter='*EveryMalformedDescriptor*:*RandomDescriptorsNeverTouchUnmappedMemory*:*AttRejectsBadEntries*'
HCOMM_TEST_DEVICES="$1,$2" gtest npu-conformance 120 integration_npu_dma --gtest_color=no --gtest_filter="${gtest_filter:-*}"
# The API conformance suite, NPU engine, two ranks on the two functions: every
# case, buffers over 2 MiB included (iova-mode=pa maps a buffer that is not
# physically contiguous in pieces, one ATT entry each: ABI 1.2 ATT_SPAN).
HCOMM_TEST_DEVICES="$1,$2" gtest api-conformance 180 integration_api_conformance --gtest_color=no \
  --gtest_filter="${api_filter:-*npu_2ranks*}"
# Last (it ends the model): device loss. Two ranks move data through the two
# functions until the host, seeing HCOMM-RUNNING, SIGKILLs hcomm-sim; both
# must end on their own with a device error naming the stopped model (or a
# peer failure, when the other rank's exit is seen first), within 60 s here
# (run-guest.sh checks the time from the kill).
echo "hcomm guest: == device-loss"
{ HCOMM_ENGINE=npu HCOMM_DEVICE="$1,$2" timeout 60 hcomm-run -n 2 -- chaos_rank --rounds 1000000 --announce
  echo $? > /tmp/loss.rc; } 2>&1 | tee /tmp/loss.out
rc=$(cat /tmp/loss.rc)
# hcomm-run gives the worst status: 11 device error, or 10 peer failure when what a rank saw first was
# its peer failing to move the payload because that peer's device was gone; either way the reason is
# the lost device.
{ [ $rc -eq 11 ] || [ $rc -eq 10 ]; } && grep -q "device error" /tmp/loss.out
result device-loss $?
