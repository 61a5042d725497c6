"""Deadlines for blocking calls, and conversion of the timeout arguments users pass.

Every blocking call in distlib has a deadline: a point on the monotonic clock after which it
gives up with an error that says what it waited for. Timeouts arrive as ``datetime.timedelta``
(torch's type) or as plain seconds; ``as_seconds`` accepts both.

Zero means "do not wait" everywhere in distlib. torch's FileStore and HashStore read a zero
timeout as "wait forever" while its TCPStore reads it as "do not wait"; a zero that silently
means forever is a hang waiting to happen, so distlib takes the TCPStore reading for every
store (see docs/stores.md).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Union

TimeoutLike = Union[timedelta, float, int]


def as_seconds(timeout: TimeoutLike, what: str = "timeout") -> float:
    """Return ``timeout`` (a timedelta or a number of seconds) as float seconds.

    Raises TypeError for anything else and ValueError for a negative value, naming ``what``.
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"{what} must be a datetime.timedelta or a number of seconds, "
            f"got {type(timeout).__name__}: {timeout!r}"
        )
    if seconds < 0:
        raise ValueError(f"{what} must not be negative, got {seconds} s")
    return seconds


def as_timedelta(timeout: TimeoutLike, what: str = "timeout") -> timedelta:
    """Return ``timeout`` as a timedelta (see ``as_seconds``)."""
    if isinstance(timeout, timedelta):
        as_seconds(timeout, what)
        return timeout
    return timedelta(seconds=as_seconds(timeout, what))


def format_duration(seconds: float) -> str:
    """A short human form: ``250ms``, ``3.2s``, ``5m00s``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s"


class Deadline:
    """A fixed point in monotonic time, ``seconds`` from now.

    >>> d = Deadline(2.0)
    >>> d.remaining() <= 2.0
    True
    """

    __slots__ = ("start", "seconds", "at")

    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.seconds = float(seconds)
        self.at = self.start + self.seconds

    @classmethod
    def of(cls, timeout: TimeoutLike, what: str = "timeout") -> "Deadline":
        return cls(as_seconds(timeout, what))

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def __repr__(self) -> str:
        return f"Deadline({self.seconds:.3f}s, {self.remaining():.3f}s left)"
