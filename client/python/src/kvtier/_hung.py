"""HungPause: how long an engine adapter leaves a hung daemon alone.

A call made with ``call_timeout`` that the daemon does not answer in time
raises DeadlineExceededError and drops the connection (its ops are
cancelled). Calling again at once would cost the next call the same
timeout, and the next: an adapter asks ``active()`` first and treats its
transfers as misses while it is True. Used by kvtier.vllm and kvtier.sglang;
owned by one connection, called under its owner's lock.
"""

from __future__ import annotations

import time

import kvtier

# The first pause after a call timed out, and the longest while it stays hung.
FIRST_PAUSE_S = 1.0
MAX_PAUSE_S = 30.0


class HungPause:
    """After a call that timed out and dropped its connection: 1 s of misses,
    doubling to MAX_PAUSE_S while the daemon stays hung; over once a call is
    answered."""

    def __init__(self) -> None:
        self._pause_s = 0.0  # the last pause, 0 once a call was answered
        self._until = 0.0

    def active(self) -> bool:
        return time.monotonic() < self._until

    def note(self, error: kvtier.Error | None, connected: bool) -> float | None:
        """What a call ended with (None: it was answered), and whether its
        client is still connected. Returns the pause that starts now, if any:
        only a timeout that dropped the connection starts one (an op that is
        merely still running does not)."""
        if error is None:
            self._pause_s = 0.0
            return None
        if not isinstance(error, kvtier.DeadlineExceededError) or connected:
            return None
        self._pause_s = min(max(2 * self._pause_s, FIRST_PAUSE_S), MAX_PAUSE_S)
        self._until = time.monotonic() + self._pause_s
        return self._pause_s
