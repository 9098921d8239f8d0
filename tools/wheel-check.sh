#!/usr/bin/env bash
# wheel-check.sh: proves each wheel of tools/wheel.sh in a fresh venv of its
# own Python (tools/pythons.sh finds it), as a user does:
#   - pip installs the wheel (--no-index: no download, no build);
#   - kvtierd --version and kvtierctl version from their console scripts;
#   - kvtierd --foreground started by its console script in an empty
#     directory with the built-in defaults (its socket and disk tier in
#     ./var/kvtier), smaller tiers set on the command line; kvtierctl status;
#   - store and load through the Python client (tools/store_load_check.py):
#     the wheel's module _kvtier for this Python, byte for byte;
#   - on Python 3.11 and later (vLLM 0.33 and SGLang 0.5.23 require it; on
#     3.10 the wheel serves engines that use the client directly):
#     `import kvtier.vllm` beside vLLM 0.33 and torch 2.13
#     (client/python/requirements-vllm-import.txt), and vLLM's connector
#     factory loading it the way vLLM does (kv_connector_module_path). Where
#     no CPU build of torch is on disk for that Python, PyPI's CUDA build is
#     what pip takes, with its CUDA libraries
#     (client/python/requirements-torch-cuda-libs.txt, installed once into
#     build/wheel-check/torch-cuda-libs and shared by those venvs); vLLM's
#     own wheel (abi3) is installed once too, into build/wheel-check/vllm;
#   - SIGTERM stops kvtierd with exit status 0.
# Each venv is removed after its check (3 to 5 GB each).
#
# Usage: tools/wheel-check.sh WHEEL...   Exit status: 0 proven, 1 failed.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=wheel-check
source tools/bare-root-lib.sh  # say, fail, await_socket, stop_daemon, small_tiers
source tools/pythons.sh
(($# > 0)) || fail "usage: tools/wheel-check.sh WHEEL..."
repo=$PWD
work=$repo/build/wheel-check
cuda_libs=$work/torch-cuda-libs
shared_vllm=$work/vllm
requirements=client/python/requirements-vllm-import.txt
mkdir -p "$work"
# vLLM's wheel is abi3, the same for every Python, and the largest: it is
# installed once, beside the venvs, and each venv sees it; they install the
# rest.
vllm_pin=$(grep '^vllm==' "$requirements")
grep -v '^vllm==' "$requirements" >"$work/requirements-but-vllm.txt"
# Quiet, pinned, without pip's notes on the machine's local indexes, and
# without compiling every module to bytecode at install (half the time of
# installing torch and vLLM's modules; what is imported compiles then).
pip_install() {  # PYTHON ARGS...
  local python=$1
  shift
  "$python" -m pip install -q --disable-pip-version-check --no-compile --no-deps "$@" \
    2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
}
daemon=
trap '[[ -z "$daemon" ]] || kill -KILL "$daemon" 2>/dev/null || true' EXIT

for wheel in "$@"; do
  wheel=$(realpath "$wheel")
  name=$(basename "$wheel")
  version=$(cut -d- -f2 <<<"$name") tag=$(cut -d- -f3 <<<"$name")
  python=$(wheel_python_of "$wheel") || fail "no Python for $name (tools/pythons.sh)"
  venv=$work/$tag
  rm -rf "$venv"
  start=$SECONDS
  "$python" -m venv "$venv" || fail "$python -m venv"
  pip_install "$venv/bin/python" --no-index "$wheel" || fail "pip install $name"
  # vLLM 0.33's Requires-Python.
  with_vllm=$("$venv/bin/python" -c 'import sys; print(int(sys.version_info >= (3, 11)))')
  torch_version="none (vLLM 0.33 requires Python 3.11 or later)"
  if ((with_vllm)); then
    if [[ "$(cat "$shared_vllm/.installed" 2>/dev/null)" != "$vllm_pin" ]]; then
      rm -rf "$shared_vllm"
      pip_install "$venv/bin/python" --target "$shared_vllm" "$vllm_pin" || fail "pip install $vllm_pin"
      echo "$vllm_pin" >"$shared_vllm/.installed"
    fi
    pip_install "$venv/bin/python" -r "$work/requirements-but-vllm.txt" || fail "pip install -r $requirements for $tag"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    echo "$shared_vllm" >"$site/vllm.pth"
    torch_version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')
    if [[ "$torch_version" != *+cpu ]]; then
      # (Installed again when their requirements change.)
      if ! cmp -s "$cuda_libs/.installed" client/python/requirements-torch-cuda-libs.txt; then
        rm -rf "$cuda_libs"
        pip_install "$venv/bin/python" --target "$cuda_libs" -r client/python/requirements-torch-cuda-libs.txt ||
          fail "pip install the CUDA libraries of PyPI's torch"
        cp client/python/requirements-torch-cuda-libs.txt "$cuda_libs/.installed"
      fi
      echo "$cuda_libs" >"$site/torch-cuda-libs.pth"
    fi
  fi
  setup=$((SECONDS - start))

  [[ "$("$venv/bin/kvtierd" --version)" == "kvtierd $version "* ]] || fail "$tag: kvtierd --version"
  [[ "$("$venv/bin/python" -m kvtier.daemon --version)" == "kvtierd $version "* ]] ||
    fail "$tag: python -m kvtier.daemon --version"
  # (Under build/, not /tmp: the disk tier opens O_DIRECT, which tmpfs refuses.)
  home=$work/home-$tag
  rm -rf "$home" && mkdir -p "$home"
  log=$home/kvtierd.log
  # (cd in a subshell, exec: $! is kvtierd's pid once its console script execs it.)
  (cd "$home" && exec "$venv/bin/kvtierd" --foreground "${small_tiers[@]}") >"$log" 2>&1 &
  daemon=$!
  socket=$home/var/kvtier/kvtierd.sock
  await_socket "$socket" "$daemon" "$log"
  "$venv/bin/kvtierctl" --socket "$socket" status >/dev/null || fail "$tag: kvtierctl status"
  "$venv/bin/python" tools/store_load_check.py "$socket" "wheel-check-$tag" || fail "$tag: store and load"
  vllm="vLLM's factory loaded the connector"
  if ((with_vllm)); then
    out=$(cd "$home" && "$venv/bin/python" "$repo/tools/vllm_connector_check.py" "$venv/" 2>&1) ||
      { echo "$out"; fail "$tag: kvtier.vllm"; }
    grep "^vLLM's connector factory loaded" <<<"$out"
  else
    vllm="no vLLM for this Python"
  fi
  stop_daemon "$daemon" "$log"
  daemon=
  say "$name: CPython $("$venv/bin/python" -c 'import platform; print(platform.python_version())'), torch" \
    "$torch_version; venv set up in ${setup} s; kvtierd from its console script served store and load; $vllm"
  rm -rf "$venv" "$home"
done
say "proven: $# wheels"
