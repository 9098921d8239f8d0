"""The programs the wheel carries: ``kvtierd`` and ``kvtierctl``.

The wheel (tools/wheel.sh) holds kvtierd, kvtierctl and libkvtier inside the
package, and the shared libraries they link beyond glibc in ``kvtier.libs``
beside it. pip puts console scripts named ``kvtierd`` and ``kvtierctl`` on
PATH; each replaces its own process with the program (exec), so signals,
exit status, standard streams and the pid are the program's own. So a user's
whole set-up is::

    pip install kvtier-*.whl
    kvtierd --foreground              # or: python -m kvtier.daemon --foreground

Who may call it: the console scripts, ``python -m kvtier.daemon``, and
programs that start kvtierd themselves (``program("kvtierd")`` is its path).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import NoReturn, Sequence

_PACKAGE = Path(__file__).resolve().parent
_PROGRAMS = ("kvtierd", "kvtierctl")


def program(name: str) -> Path:
    """The path of a program of the wheel: ``"kvtierd"`` or ``"kvtierctl"``."""
    if name not in _PROGRAMS:
        raise ValueError(f"no program {name!r} in kvtier; there are {', '.join(_PROGRAMS)}")
    path = _PACKAGE / "bin" / name
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(
            f"{path}: this kvtier package carries no {name} (it is a build tree's, not the wheel of tools/wheel.sh): "
            "install the wheel, or the Debian package, which has /usr/bin/" + name
        )
    return path


def library() -> Path:
    """The path of libkvtier, the C and C++ client library, that the wheel carries."""
    found = sorted((_PACKAGE / "lib").glob("libkvtier.so.*"))
    if not found:
        raise FileNotFoundError(f"{_PACKAGE / 'lib'}: this kvtier package carries no libkvtier")
    return found[0]


def example_config() -> Path:
    """The path of the example configuration, every key with its default and what it means."""
    return _PACKAGE / "share" / "kvtier.example.yaml"


def _exec(name: str, args: Sequence[str] | None) -> NoReturn:
    path = program(name)
    argv = list(sys.argv[1:] if args is None else args)
    sys.stdout.flush()
    sys.stderr.flush()
    # Python ignores SIGPIPE and SIGXFSZ, and an ignored signal stays ignored
    # across exec: the program gets the defaults, as when run directly
    # (`kvtierctl stats | head` ends quietly).
    for sig in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, sig):
            signal.signal(getattr(signal, sig), signal.SIG_DFL)
    os.execv(path, [name, *argv])


def main(args: Sequence[str] | None = None) -> NoReturn:
    """The ``kvtierd`` console script: runs kvtierd with these arguments (default: the command line's)."""
    _exec("kvtierd", args)


def kvtierctl(args: Sequence[str] | None = None) -> NoReturn:
    """The ``kvtierctl`` console script: runs kvtierctl with these arguments."""
    _exec("kvtierctl", args)


if __name__ == "__main__":
    main()
