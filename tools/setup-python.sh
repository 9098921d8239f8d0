#!/usr/bin/env bash
# Makes the Python test environment: a virtual environment in build/venv (or
# $KVTIER_VENV) from `python3` (or $KVTIER_PYTHON_EXE), with the pinned
# packages of client/python/requirements-test.txt. Idempotent: it installs again
# only when the requirements changed. Prints nothing but progress; the venv's
# interpreter is $KVTIER_VENV/bin/python. tools/test.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${KVTIER_VENV:-build/venv}
python=${KVTIER_PYTHON_EXE:-python3}
requirements=client/python/requirements-test.txt
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
# (pip warns of every package the machine's local indexes lack: not news.)
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$requirements" \
  2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
cp "$requirements" "$stamp"
echo "setup-python: done ($("$venv/bin/python" --version))"
