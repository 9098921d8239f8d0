"""kvtier's exceptions: one base class, a subclass per status code.

The C++ binding raises the subclass of each error's status code
(``error_class``). ``UnavailableError`` means the daemon is not there right
now (restarting, or not started): an engine treats it as a miss and goes on;
the client reconnects by itself.
"""

from __future__ import annotations


class Error(Exception):
    """Any error kvtier reports. ``code`` names its status code."""

    code: str = "Unknown"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidArgumentError(Error, ValueError):
    """Malformed input: a wrong length, range, dtype or layout."""

    code = "InvalidArgument"


class NotFoundError(Error):
    code = "NotFound"


class AlreadyExistsError(Error):
    code = "AlreadyExists"


class ResourceExhaustedError(Error):
    """No room (every block of the tier leased or moving) or a quota."""

    code = "ResourceExhausted"


class FailedPreconditionError(Error):
    """The call does not fit the state: e.g. the client is closed."""

    code = "FailedPrecondition"


class OutOfRangeError(Error, IndexError):
    code = "OutOfRange"


class PermissionDeniedError(Error, PermissionError):
    code = "PermissionDenied"


class UnauthenticatedError(Error, PermissionError):
    code = "Unauthenticated"


class UnavailableError(Error, ConnectionError):
    """The daemon is not reachable now: a miss, not a failure."""

    code = "Unavailable"


class DeadlineExceededError(Error, TimeoutError):
    """A wait timed out; the operation goes on (wait again)."""

    code = "DeadlineExceeded"


class AbortedError(Error):
    code = "Aborted"


class CancelledError(Error):
    code = "Cancelled"


class UnimplementedError(Error, NotImplementedError):
    """Not supported here: e.g. CUDA memory without CUDA in libkvtier or the daemon."""

    code = "Unimplemented"


class IoError(Error, OSError):
    code = "IoError"


class CorruptionError(Error):
    code = "Corruption"


class InternalError(Error):
    code = "Internal"


_BY_CODE: dict[str, type[Error]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        ResourceExhaustedError,
        FailedPreconditionError,
        OutOfRangeError,
        PermissionDeniedError,
        UnauthenticatedError,
        UnavailableError,
        DeadlineExceededError,
        AbortedError,
        CancelledError,
        UnimplementedError,
        IoError,
        CorruptionError,
        InternalError,
    )
}


def error_class(code: str) -> type[Error]:
    """The exception class of a status code name (``Error`` for an unknown one)."""
    return _BY_CODE.get(code, Error)
