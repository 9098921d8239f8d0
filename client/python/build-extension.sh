#!/usr/bin/env bash
# build-extension.sh: builds kvtier's Python extension from the GPU bundle
# (tools/gpu-bundle.sh copies this file to BUNDLE/python/) against the
# bundle's libkvtier.so and headers, for the python3 on PATH (or $PYTHON):
# what a machine with Python and PyTorch but none of Debian's libraries needs.
# The package (the module and its .py files) lands in OUT_DIR/kvtier; use it
# with PYTHONPATH=OUT_DIR. Needs a C++20 compiler (c++, g++ or clang++, or
# $CXX) and pybind11's headers (pip's pybind11, else the system's).
#
# Usage: BUNDLE/python/build-extension.sh OUT_DIR. Exit status: 0 built.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=$(dirname "$here")
out=${1:?usage: build-extension.sh OUT_DIR}
python=${PYTHON:-python3}

cxx=${CXX:-$(command -v c++ || command -v g++ || command -v clang++ || true)}
if [[ -z "$cxx" ]]; then
  echo "build-extension: no C++ compiler (c++, g++, clang++ or \$CXX) on this machine" >&2
  exit 1
fi
command -v "$python" >/dev/null 2>&1 || { echo "build-extension: no $python" >&2; exit 1; }
if ! includes=$("$python" -m pybind11 --includes 2>/dev/null); then
  # No pip pybind11: Python's own headers, and pybind11's in the system path.
  includes="-I$("$python" -c 'import sysconfig; print(sysconfig.get_path("include"))')"
fi
suffix=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
mkdir -p "$out/kvtier"
cp "$here"/src/kvtier/* "$out/kvtier/"
echo "build-extension: $("$cxx" --version | head -1); $("$python" --version)"
# shellcheck disable=SC2086  # $includes is a list of -I flags
"$cxx" -std=c++20 -O2 -shared -fPIC -fvisibility=hidden $includes -I"$bundle/include" "$here"/src/*.cc \
  -L"$bundle/lib" -lkvtier -Wl,-rpath,"$bundle/lib" -o "$out/kvtier/_kvtier$suffix"
echo "build-extension: $out/kvtier/_kvtier$suffix"
