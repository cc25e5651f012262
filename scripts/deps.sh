#!/usr/bin/env bash
# Installs the Debian 12 packages hcomm builds and tests with (idempotent).
set -euo pipefail
pkgs=(build-essential meson ninja-build pkg-config
      libnuma-dev libgtest-dev libgmock-dev libbenchmark-dev
      libibverbs-dev libdpdk-dev openmpi-bin libopenmpi-dev
      zlib1g-dev python3-scapy tshark   # RoCEv2 ICRC (crc32), wire checks (tests/unit/roce_wire_check.py)
      qemu-system-x86 busybox-static cpio xz-utils   # qemu suite + rdma guest (tests/qemu/)
      python3-dev pybind11-dev python3-torch libtorch-dev python3-pytest)  # python/: the torch backend
# bench-only (bench/compare.py): scripts/deps.sh --bench
[ "${1:-}" = "--bench" ] && pkgs+=(ucx-utils python3-matplotlib)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "deps: installing ${missing[*]}"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
