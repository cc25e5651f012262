#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs the unit and
# integration suites (they start hcomm-sim themselves), the chaos suite
# (jobs whose ranks or simulator are SIGKILLed at random moments, fixed
# seeds), the fuzz suite
# (deterministic mutation runs of the parser fuzz targets) and the qemu suite
# (a QEMU guest drives hcomm-sim through vfio-pci; downloads Debian's kernel
# package once into BUILD_DIR/qemu-guest/cache) and, when the Python package
# was built, the python suite (the torch backend; PyTorch's own test cases).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh "$@"
suites=(--suite unit --suite integration --suite chaos --suite fuzz --suite qemu)
# python/ (the torch backend) when it was built: on wherever the packages are (scripts/deps.sh installs them)
grep -q "torch_backend" <(meson test -C "${BUILD_DIR:-build}" --list 2>/dev/null) && suites+=(--suite python)
meson test -C "${BUILD_DIR:-build}" "${suites[@]}" --print-errorlogs
