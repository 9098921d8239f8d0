#!/usr/bin/env bash
# Checks `cmake --install` from a consumer's side: installs BUILD_DIR into a
# temporary prefix, compiles each installed header on its own, builds
# tests/install/consumer with find_package(kvtier) and a C program with
# `pkg-config --cflags --libs kvtier`, loads libkvtier.so with Python's
# ctypes, validates the installed example config with the installed kvtierd
# and the unit with systemd-analyze (where present), then runs both programs
# and the installed kvtierctl against the installed kvtierd. Nothing outside
# the temporary prefix is touched. tools/test.sh runs it after ctest.
#
# Usage: tools/check-install.sh [BUILD_DIR]   (default build/debug, configured
# already; its install targets are built if they are not yet). Exit 0 on
# success.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${1:-build/debug}
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  echo "check-install: $build_dir is not a configured build directory" >&2
  exit 2
fi
tmp=$(mktemp -d /tmp/kvtier-install.XXXXXX)
prefix=$tmp/prefix
daemon_pid=
cleanup() {
  if [[ -n "$daemon_pid" ]]; then kill "$daemon_pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "check-install: FAILED: $*" >&2
  exit 1
}
say() { echo "check-install: $*"; }

cmake --build "$build_dir" -j"$(nproc)" --target kvtierd kvtierctl kvtier-bench kvtier_shared >/dev/null
cmake --install "$build_dir" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install"; }

pc=$(find "$prefix" -name kvtier.pc -path '*/pkgconfig/*')
[[ -n "$pc" ]] || fail "no kvtier.pc installed"
libdir=$(dirname "$(dirname "$pc")")
for f in bin/kvtierd bin/kvtierctl bin/kvtier-bench include/kvtier/client.h include/kvtier/kvtier.h \
         include/kvtier/shm_kv_cache.h share/kvtier/kvtier.example.yaml lib/systemd/system/kvtierd.service \
         lib/sysusers.d/kvtier.conf; do
  [[ -f "$prefix/$f" ]] || fail "$f not installed"
done
for f in libkvtier.so cmake/kvtier/kvtierConfig.cmake cmake/kvtier/kvtierConfigVersion.cmake \
         cmake/kvtier/kvtierTargets.cmake; do
  [[ -e "$libdir/$f" ]] || fail "${libdir#"$prefix"/}/$f not installed"
done
say "installed $(find "$prefix" -type f | wc -l) files into a temporary prefix"

# Each public header compiles on its own against the installed tree only, so
# a common/ header it includes but the install misses fails here.
for h in "$prefix"/include/kvtier/*.h; do
  echo "#include <kvtier/$(basename "$h")>" |
    c++ -std=c++20 -fsyntax-only -Wall -Werror -I"$prefix/include" -x c++ - ||
    fail "installed kvtier/$(basename "$h") does not compile on its own"
done
echo '#include <kvtier/kvtier.h>' | cc -std=c11 -fsyntax-only -Wall -Werror -I"$prefix/include" -x c - ||
  fail "installed kvtier/kvtier.h is not C"

# CMake: find_package(kvtier) + kvtier::client, found through CMAKE_PREFIX_PATH.
cmake -S tests/install/consumer -B "$tmp/consumer" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/consumer.log" 2>&1 || { cat "$tmp/consumer.log"; fail "consumer: configure"; }
grep -q "^kvtier_DIR:PATH=$prefix/" "$tmp/consumer/CMakeCache.txt" ||
  fail "find_package(kvtier) found a kvtier outside the temporary prefix"
cmake --build "$tmp/consumer" >>"$tmp/consumer.log" 2>&1 || { cat "$tmp/consumer.log"; fail "consumer: build"; }

# pkg-config, from C.
export PKG_CONFIG_PATH="$libdir/pkgconfig"
[[ "$(pkg-config --modversion kvtier)" == "$(sed -n 's/^Version: //p' "$pc")" ]] || fail "pkg-config kvtier"
# shellcheck disable=SC2046
cc -std=c11 -Wall -Wextra -Werror tests/install/consumer/c_consumer.c -o "$tmp/c_consumer" \
  $(pkg-config --cflags --libs kvtier) || fail "c_consumer: compile with pkg-config"

# Offline: the programs load the installed libkvtier.so (the CMake one by its
# RUNPATH, the C one by LD_LIBRARY_PATH, as pkg-config sets no run path).
ldd_out=$(ldd "$tmp/consumer/consumer")
[[ "$ldd_out" == *"=> $libdir/libkvtier.so"* ]] || { echo "$ldd_out"; fail "consumer does not load the installed libkvtier.so"; }
"$tmp/consumer/consumer" || fail "consumer (offline)"
LD_LIBRARY_PATH="$libdir" "$tmp/c_consumer" || fail "c_consumer (offline)"
# Python engines load the same library with ctypes.
if command -v python3 >/dev/null; then
  python3 - "$libdir/libkvtier.so" <<'PY' || fail "python3 ctypes on libkvtier.so"
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.kvtier_last_error.restype = ctypes.c_char_p
client = ctypes.c_void_p()
st = lib.kvtier_connect(b"/nonexistent/kvtier/kvtierd.sock", None, b"py", ctypes.byref(client))
assert st == 9 and lib.kvtier_last_error(), (st, lib.kvtier_last_error())  # KVTIER_UNAVAILABLE
PY
fi

# The Python package, where `cmake --install` put it for the Python the build
# was configured with (its site-packages under the prefix).
py_exe=$(sed -n 's/^Python_EXECUTABLE:[A-Z]*=//p' "$build_dir/CMakeCache.txt")
py_dir=$(sed -n 's/^KVTIER_PYTHON_INSTALL_DIR:[A-Z]*=//p' "$build_dir/CMakeCache.txt")
if [[ -n "$py_dir" && -n "$py_exe" ]]; then
  [[ -f "$prefix/$py_dir/kvtier/__init__.py" ]] || fail "the Python package is not in $prefix/$py_dir"
  (cd "$tmp" && PYTHONPATH="$prefix/$py_dir" PYTHONNOUSERSITE=1 "$py_exe" -c "
import kvtier, sys
assert kvtier.__file__.startswith(sys.argv[1]), kvtier.__file__
try:
    kvtier.Client.connect('/nonexistent/kvtier/kvtierd.sock')
except kvtier.UnavailableError:
    pass
" "$prefix") || fail "import kvtier from the installed package"
  say "the Python package imports from $prefix/$py_dir"
fi

"$prefix/bin/kvtierd" --config "$prefix/share/kvtier/kvtier.example.yaml" --check-config >"$tmp/check.log" 2>&1 ||
  { cat "$tmp/check.log"; fail "installed kvtierd --check-config of the installed example config"; }
unit=$prefix/lib/systemd/system/kvtierd.service
grep -q "^ExecStart=$prefix/bin/kvtierd --foreground " "$unit" || fail "kvtierd.service: ExecStart is not the installed kvtierd"
if command -v systemd-analyze >/dev/null; then
  systemd-analyze verify "$unit" || fail "systemd-analyze verify kvtierd.service"
else
  say "no systemd-analyze here: kvtierd.service not verified"
fi

# Online: the installed daemon (small, host backend, no disk tier, metrics
# off so that no port is needed), the programs and kvtierctl against it. Not
# --foreground: kvtierd returns once its socket listens.
sock=$tmp/kvtierd.sock
"$prefix/bin/kvtierd" --pid-file "$tmp/kvtierd.pid" --set "socket.path=$sock" --set "state_dir=$tmp/state" \
  --set device.backend=host --set tiers.host.bytes=64MiB --set tiers.disk.enabled=false \
  --set metrics.enabled=false 2>"$tmp/kvtierd.log" || { cat "$tmp/kvtierd.log"; fail "installed kvtierd did not start"; }
daemon_pid=$(cat "$tmp/kvtierd.pid")
"$tmp/consumer/consumer" "$sock" || { cat "$tmp/kvtierd.log"; fail "consumer (against kvtierd)"; }
LD_LIBRARY_PATH="$libdir" "$tmp/c_consumer" "$sock" || { cat "$tmp/kvtierd.log"; fail "c_consumer (against kvtierd)"; }
"$prefix/bin/kvtierctl" --socket "$sock" stats >/dev/null || fail "installed kvtierctl stats"
kill "$daemon_pid"
for _ in $(seq 100); do kill -0 "$daemon_pid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$daemon_pid" 2>/dev/null && fail "installed kvtierd did not stop on SIGTERM"
daemon_pid=
say "OK"
