#!/usr/bin/env bash
# deb.sh: builds kvtier_<version>_amd64.deb (cmake/KvtierPackage.cmake) from a
# Release build for /usr in build/deb: kvtierd, kvtierctl, libkvtier and its
# headers, CMake and pkg-config files, the systemd unit, the sysusers file
# and /etc/kvtier/kvtier.yaml. Its Depends: come from the libraries the
# binaries link (dpkg-shlibdeps). Built without CUDA: the CUDA runtime is no
# Debian package, so a package for GPU hosts needs NVIDIA's repository as
# well (not done yet; the wheel carries the CUDA build). Prints the
# package's path.
#
# Usage: tools/deb.sh [BUILD_DIR]   (default build/deb; needs tools/setup-deps.sh).
# Environment: KVTIER_WERROR (ON: warnings are errors, as tools/test.sh builds).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/deb}
jobs=${KVTIER_BUILD_JOBS:-$(nproc)}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr \
  -DKVTIER_BUILD_TESTS=OFF -DKVTIER_PYTHON=OFF -DKVTIER_CUDA=OFF -DKVTIER_WERROR="${KVTIER_WERROR:-OFF}" >"$build.configure.log" 2>&1 ||
  { tail -20 "$build.configure.log"; exit 1; }
cmake --build "$build" -j"$jobs" --target kvtierd kvtierctl kvtier_shared >"$build.build.log" 2>&1 ||
  { tail -30 "$build.build.log"; exit 1; }
(cd "$build" && cpack -G DEB --config CPackConfig.cmake >cpack.log 2>&1) || { tail -30 "$build/cpack.log"; exit 1; }
deb=$(ls "$build"/kvtier_*_amd64.deb)
echo "$deb"
