#!/usr/bin/env bash
# Installs kvtier's build and test dependencies from Debian packages.
# Idempotent: runs `apt-get update` and `apt-get install` only when a package
# is missing. Needs root (or sudo).
set -euo pipefail

PACKAGES=(
  # toolchain (ninja and ccache: tools/test.sh's builds share one compiler cache,
  # so each object its Release trees have in common is compiled once)
  build-essential cmake pkg-config git clang ninja-build ccache
  # clang's sanitizer runtimes (ASan, UBSan, TSan, libFuzzer): only recommended by clang,
  # and this script installs without recommends
  libclang-rt-14-dev
  # libraries (see ../shared/DESIGN.md, "Dependencies")
  liburing-dev librocksdb-dev libxxhash-dev libzstd-dev prometheus-cpp-dev libyaml-cpp-dev
  libflatbuffers-dev flatbuffers-compiler libspdlog-dev libcli11-dev libexpected-dev
  # tests and benchmarks (fio: kvtier-bench disk's baseline; e2fsprogs: mkfs.ext4 for
  # startup_test's small loop-mounted file system)
  libgtest-dev libgmock-dev libbenchmark-dev fio e2fsprogs
  # tools/plot-bench.sh (gnuplot without X11; it has the png and pngcairo terminals)
  gnuplot-nox
  # promtool (package prometheus): the metrics test checks /metrics with it
  prometheus
  # kvtier-bench redis and lookup's baseline: a redis-server the bench starts, hiredis
  redis-server libhiredis-dev
  # KV events (daemon/kv_events*): msgpack, and ZMQ to publish them
  libmsgpack-cxx-dev libzmq3-dev cppzmq-dev
  # the Python package (client/python/): pybind11 and Python's headers; the test
  # virtual environment (tools/setup-python.sh) is made with venv
  pybind11-dev python3-dev python3-venv
  # tools/bare-root.sh: a minimal Debian root to run the GPU bundle and the
  # Debian package in (binutils' objdump and strip come with build-essential);
  # tools/deb.sh: dpkg-shlibdeps computes the package's Depends; tools/wheel.sh:
  # unzip looks into the wheel (file modes included)
  debootstrap dpkg-dev unzip
  # tools/image.sh: the sidecar image as an OCI archive, without a container
  # daemon or a registry (umoci), checked by skopeo; tools/image-check.sh runs
  # its entrypoint under runc
  umoci skopeo runc
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "setup-deps: missing ${missing[*]}; run as root or install sudo" >&2
    exit 1
  fi
fi
echo "setup-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup-deps: done"
