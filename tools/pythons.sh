# pythons.sh: the CPython interpreters kvtier's wheels are built for (3.10 to
# 3.13: the ones vLLM supports), found on this machine; sourced by
# tools/wheel.sh and tools/wheel-check.sh, never run.
#
#   wheel_pythons            prints "3.X PATH" for each minor version found
#                            (python3.X on PATH, else pyenv's newest 3.X under
#                            $PYENV_ROOT, else `pyenv root`); PATH is the
#                            interpreter itself (sys.executable), not a shim
#   wheel_python_of WHEEL    prints the interpreter for WHEEL's cpXY tag
#
# KVTIER_WHEEL_PYTHONS (a space-separated list of interpreters) replaces the
# search.
KVTIER_WHEEL_MINORS="10 11 12 13"

wheel_pythons() {
  local minor path
  if [[ -n "${KVTIER_WHEEL_PYTHONS:-}" ]]; then
    for path in $KVTIER_WHEEL_PYTHONS; do
      "$path" -c 'import sys; print("%d.%d" % sys.version_info[:2], sys.executable)' || return 1
    done
    return 0
  fi
  local pyenv_root=${PYENV_ROOT:-$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")}
  for minor in $KVTIER_WHEEL_MINORS; do
    # pyenv's versions of 3.X, newest first.
    # (A pyenv shim on PATH answers for a version that is not selected with
    # an error: the next candidate is tried.)
    for path in $(command -v "python3.$minor" 2>/dev/null) \
      $(ls -d "$pyenv_root"/versions/3."$minor".*/bin/python3."$minor" 2>/dev/null | sort -rV); do
      if path=$("$path" -c 'import sys; print(sys.executable)' 2>/dev/null) && [[ -n "$path" ]]; then
        echo "3.$minor $path"
        break
      fi
    done
  done
}

wheel_python_of() {
  local tag version path
  tag=$(basename "$1" | cut -d- -f3)  # cp312
  while read -r version path; do
    if [[ "cp${version/./}" == "$tag" ]]; then
      echo "$path"
      return 0
    fi
  done < <(wheel_pythons)
  return 1
}
