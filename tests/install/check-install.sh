#!/usr/bin/env bash
# Installs the build into a staging directory and checks what landed where: commands in bin/, the
# examples outside bin/ (libexec/hcomm/examples, sources in share/doc/hcomm/examples), the docs, and
# that the installed pkg-config file builds a program that uses hcomm, which then runs.
# Usage: check-install.sh BUILD_DIR SOURCE_DIR SANITIZE (the b_sanitize option: none, or skip)
set -euo pipefail
build=$1 src=$2 sanitize=$3
if [ "$sanitize" != none ]; then
  echo "SKIP: a sanitizer build's library needs the sanitizer runtime in every program linked to it"
  exit 77
fi
stage=$(mktemp -d /tmp/hcomm-install-XXXXXX)
trap 'rm -rf "$stage"' EXIT
meson install -C "$build" --destdir "$stage" --no-rebuild --quiet >/dev/null
prefix=$(meson introspect "$build" --buildoptions | /usr/bin/python3 -c \
  'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == "prefix"))')
root=$stage$prefix
fail() { echo "FAIL: $*" >&2; exit 1; }
for c in hcomm-run hcomm-probe hcomm-sim hcomm-bench; do [ -x "$root/bin/$c" ] || fail "bin/$c missing"; done
for e in point_to_point put_get parameter_server pipeline; do
  [ ! -e "$root/bin/$e" ] || fail "example $e installed as a command in bin/"
  [ -x "$root/libexec/hcomm/examples/$e" ] || fail "libexec/hcomm/examples/$e missing"
  [ -f "$root/share/doc/hcomm/examples/$e.cpp" ] || fail "share/doc/hcomm/examples/$e.cpp missing"
done
for d in README.md api.md python.md; do [ -f "$root/share/doc/hcomm/$d" ] || fail "share/doc/hcomm/$d missing"; done
pc=$(find "$root" -name hcomm.pc | head -1)
[ -n "$pc" ] || fail "hcomm.pc missing"
# The installed .pc names the final prefix: a sysroot makes it point into the stage.
export PKG_CONFIG_PATH=$(dirname "$pc") PKG_CONFIG_SYSROOT_DIR=$stage
flags=$(pkg-config --cflags --libs hcomm) || fail "pkg-config hcomm"
lib=$(find "$root" -name 'libhcomm.so.*' | head -1)
[ -n "$lib" ] || fail "libhcomm.so missing"
libdir=$(dirname "$lib")
g++ -std=c++20 -o "$stage/p2p" "$src/examples/point_to_point.cpp" $flags -Wl,-rpath,"$libdir" \
  || fail "the example does not build against the installed hcomm"
g++ -std=c++20 -x c++ -o "$stage/version" - $flags -Wl,-rpath,"$libdir" <<'C' || fail "a C API program does not build"
#include <hcomm/hcomm.h>
#include <cstdio>
int main() { std::printf("%u\n", hcomm_api_version()); return hcomm_api_version() == HCOMM_API_VERSION ? 0 : 1; }
C
"$stage/version" >/dev/null || fail "the installed library's API version is not its header's"
out=$(HCOMM_ENGINE=host "$root/bin/hcomm-run" -n 2 --timeout 60 "$stage/p2p" 2>&1) || fail "p2p under the installed hcomm-run: $out"
echo "$out" | grep -q "\[1\]" || fail "no output from rank 1: $out"
echo "install ok: $root"
