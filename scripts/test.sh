#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs the unit and
# integration suites (the integration suites start hcomm-sim themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh "$@"
meson test -C "${BUILD_DIR:-build}" --suite unit --suite integration --print-errorlogs
