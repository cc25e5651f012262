#!/usr/bin/env bash
# Builds the QEMU guest the `qemu` test suite boots: Debian's own kernel
# (downloaded as a package with apt-get download, unpacked, never installed)
# and a busybox initramfs holding the VFIO modules, the project's binaries,
# the shared libraries they need and tests/qemu/guest-init.sh as /init.
#
#   tests/qemu/build-guest.sh BUILD_DIR OUT_DIR [rdma]
#
# Writes OUT_DIR/vmlinuz and OUT_DIR/initramfs.cpio. The kernel package is
# cached in ${HCOMM_QEMU_CACHE:-OUT_DIR/cache} (one download per version).
# Needs: apt-get (Debian's registry), dpkg-deb, busybox-static, cpio (rdma: also xz, readelf).
#
# The rdma flavour (third argument `rdma`, tests/qemu/run-rdma.sh) is a
# different guest: Soft-RoCE instead of VFIO. It writes OUT_DIR/vmlinux (the
# same kernel, uncompressed: it boots about twice as fast under TCG) and
# OUT_DIR/initramfs-rdma.cpio: the modules rdma_rxe, virtio_net, sch_netem
# and their dependencies; userspace unpacked from Debian packages (never
# installed on the host; the .debs are cached in CACHE/debs): libibverbs
# with the rxe provider, perftest, ibverbs-utils, iproute2's rdma and tc,
# UCX's ucx_perftest, with every shared library they need, also from
# packages; tests/qemu/rdma-init.sh as /init. It needs no project binary:
# run-rdma.sh appends those per run (HCOMM_RDMA_FILES).
set -euo pipefail
build=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
flavour=${3:-vfio}
case "$flavour" in vfio|rdma) ;; *) echo "build-guest: unknown flavour $flavour (vfio, rdma)" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")" && pwd)
cache=${HCOMM_QEMU_CACHE:-$out/cache}
mkdir -p "$cache"

for tool in dpkg-deb cpio; do
  command -v $tool >/dev/null || { echo "build-guest: $tool missing (scripts/deps.sh --qemu)" >&2; exit 2; }
done
busybox=/bin/busybox  # busybox-static; the dynamic busybox package would need its libc too
ldd "$busybox" >/dev/null 2>&1 && busybox=""
[ -n "$busybox" ] || { echo "build-guest: /bin/busybox is not busybox-static (scripts/deps.sh --qemu)" >&2; exit 2; }

# ---- kernel: the version Debian's linux-image-amd64 points at ----
resolve() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'; }
kpkg=${HCOMM_QEMU_KERNEL:-$(resolve)}
if [ -z "$kpkg" ] && [ "$(id -u)" -eq 0 ]; then  # a machine whose package lists were never fetched
  apt-get update -qq >&2 || true
  kpkg=$(resolve)
fi
[ -n "$kpkg" ] || { echo "build-guest: cannot resolve linux-image-amd64 (apt-get update?)" >&2; exit 2; }
deb=$(ls "$cache"/"${kpkg}"_*.deb 2>/dev/null | head -1 || true)
if [ -z "$deb" ]; then
  echo "build-guest: downloading $kpkg" >&2
  (cd "$cache" && apt-get download -q "$kpkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true)
  deb=$(ls "$cache"/"${kpkg}"_*.deb 2>/dev/null | head -1 || true)
  [ -n "$deb" ] || { echo "build-guest: apt-get download $kpkg failed" >&2; exit 2; }
fi
kdir="$cache/${kpkg}"
if [ ! -d "$kdir/boot" ]; then
  ktmp=$(mktemp -d "$kdir.XXXXXX")  # builds side by side each unpack, the first one's stays
  dpkg-deb -x "$deb" "$ktmp"
  mv -T "$ktmp" "$kdir" 2>/dev/null || rm -rf "$ktmp"
fi
kver=$(ls "$kdir/lib/modules" | head -1)
cp "$kdir/boot/vmlinuz-$kver" "$out/vmlinuz"
if [ "$flavour" = rdma ]; then
  . "$here/build-rdma-guest.inc"
  exit 0
fi

# ---- initramfs ----
root="$out/root"
rm -rf "$root"
mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,run,lib/modules,lib64,usr/lib/x86_64-linux-gnu,hcomm}
cp "$busybox" "$root/bin/busybox"
for m in virt/lib/irqbypass drivers/vfio/vfio drivers/vfio/vfio_iommu_type1 drivers/vfio/vfio_virqfd \
         drivers/vfio/pci/vfio-pci-core drivers/vfio/pci/vfio-pci; do
  f="$kdir/lib/modules/$kver/kernel/$m.ko"
  [ -f "$f" ] || f="$f.xz"
  [ -f "$f" ] || { echo "build-guest: module $m missing from $kpkg" >&2; exit 2; }
  cp "$f" "$root/lib/modules/"
done
bins=(
  "$build/tools/hcomm-probe"
  "$build/tests/integration_npu_dma"
  "$build/tests/integration_api_conformance"
  "$build/tools/hcomm-run"
  "$build/tests/chaos_rank"
)
for b in "${bins[@]}"; do
  [ -x "$b" ] || { echo "build-guest: $b not built" >&2; exit 2; }
  cp "$b" "$root/hcomm/"
  strip --strip-unneeded "$root/hcomm/$(basename "$b")" 2>/dev/null || true
  # The shared libraries, at the paths the dynamic loader looks in.
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\/lib64\// {print $1}' | while read -r lib; do
    case "$lib" in
      /lib/*|/lib64/*|/usr/lib/*) dest="$root$lib" ;;
      *) dest="$root/lib/x86_64-linux-gnu/$(basename "$lib")" ;;  # the project's own (build-tree rpath)
    esac
    mkdir -p "$(dirname "$dest")"
    [ -f "$dest" ] || cp -L "$lib" "$dest"
  done
done
cp "$here/guest-init.sh" "$root/init"
chmod 755 "$root/init"
echo "$kver" > "$root/hcomm/kernel-version"
(cd "$root" && find . -print0 | cpio --null -o -H newc --quiet) > "$out/initramfs.cpio"
rm -rf "$root"
echo "build-guest: $out/vmlinuz ($kver), $out/initramfs.cpio ($(du -h "$out/initramfs.cpio" | cut -f1))" >&2
