#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs the unit and
# integration suites (they start hcomm-sim themselves), the fuzz suite
# (deterministic mutation runs of the parser fuzz targets) and the qemu suite
# (a QEMU guest drives hcomm-sim through vfio-pci; downloads Debian's kernel
# package once into BUILD_DIR/qemu-guest/cache).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh "$@"
meson test -C "${BUILD_DIR:-build}" --suite unit --suite integration --suite fuzz --suite qemu --print-errorlogs
