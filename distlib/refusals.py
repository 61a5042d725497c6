"""``RefusalLog``: a listener's refusals, logged once per peer address per interval, with a count.

Why: a listener names every connection it refuses (the peer, and what it did), but a peer
that opens thousands of bad connections a second must not be able to write thousands of log
lines a second: the log is where an operator looks, and its disk is finite. So the first
refusal of an address is logged in full; the ones after it, within ``interval_s``, are only
counted, and one line says how many there were, and why, when the interval ends.
The store server and the mesh's listener use it alike.

``totals`` keeps, per address, how many connections were refused in all and the last reason,
for the errors that say why a rank waited in vain ("meanwhile it refused ..."). The addresses
kept are bounded (``max_addresses``): past it, new addresses are counted under one entry,
``OTHER``, so that a peer that changes its address cannot grow the listener's memory.

Not thread-safe: each listener calls it from the thread that runs it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional

from .deadline import format_duration

#: How long refusals of one address are counted, not logged, after one is logged.
INTERVAL_S = 10.0
#: Addresses tracked at most; the rest are counted under OTHER.
MAX_ADDRESSES = 1024
#: The entry for addresses past ``max_addresses``.
OTHER = "other addresses"
#: Distinct reasons one interval's count line lists; the rest are counted as "other reasons".
MAX_REASONS = 4


class _Window:
    __slots__ = ("ends", "suppressed", "reasons", "level")

    def __init__(self, ends: float, level: int):
        self.ends = ends
        self.suppressed = 0
        self.reasons: Dict[str, int] = {}
        self.level = level

    def count(self, reason: str, level: int) -> None:
        self.suppressed += 1
        if reason not in self.reasons and len(self.reasons) >= MAX_REASONS:
            reason = "other reasons"
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.level = max(self.level, level)


class RefusalLog:
    """Refusals of one listener. ``refused(address, text)`` for each one; ``flush()`` when
    ``due`` has come, to log the counts of intervals that ended (a listener with a timer calls
    it from there; without one, counts are logged at the address's next refusal). ``noun``
    names what is counted in the lines ("refusals"; the store server also counts its clients'
    connections and disconnections with one)."""

    def __init__(self, logger: logging.Logger, interval_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic, max_addresses: int = MAX_ADDRESSES,
                 noun: str = "refusals"):
        self.logger = logger
        self.noun = noun
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        self.clock = clock
        self.max_addresses = max_addresses
        #: address -> [connections refused in all, the last reason]
        self.totals: Dict[str, List] = {}
        self._windows: Dict[str, _Window] = {}
        #: When the earliest interval with uncounted refusals ends (None: none does).
        self.due: Optional[float] = None

    def refused(self, address: str, text: str, reason: str = "", level: int = logging.WARNING) -> bool:
        """A connection from ``address`` was refused: ``text`` is the full log line, ``reason``
        the short form kept for the counts (default: ``text``). Returns whether it was logged
        (False: counted in the address's current interval)."""
        reason = reason or text
        if address not in self.totals and len(self.totals) >= self.max_addresses:
            address = OTHER
        total = self.totals.get(address)
        if total is None:
            self.totals[address] = [1, reason]
        else:
            total[0] += 1
            total[1] = reason
        now = self.clock()
        window = self._windows.get(address)
        if window is not None and now < window.ends:
            window.count(reason, level)
            if self.due is None or window.ends < self.due:
                self.due = window.ends
            return False
        if window is not None and window.suppressed:
            self._log_count(address, window)
        self._windows[address] = _Window(now + self.interval_s, level)
        self.logger.log(level, "%s (further %s of %s in the next %s are counted in one line)", text, self.noun,
                        address, format_duration(self.interval_s))
        return True

    def flush(self, final: bool = False) -> None:
        """Log the counts of intervals that have ended (``final``: of every interval, the
        listener is closing); forget addresses whose interval ended."""
        now = float("inf") if final else self.clock()
        due = None
        for address in list(self._windows):
            window = self._windows[address]
            if now >= window.ends:
                if window.suppressed:
                    self._log_count(address, window)
                del self._windows[address]
            elif window.suppressed and (due is None or window.ends < due):
                due = window.ends
        self.due = due

    def _log_count(self, address: str, window: _Window) -> None:
        reasons = "; ".join(f"{n} x {reason}" for reason, n in window.reasons.items())
        self.logger.log(window.level, "%d more %s of %s in %s: %s", window.suppressed, self.noun, address,
                        format_duration(self.interval_s), reasons)

    def summary(self) -> str:
        """Every address's count and last reason, for an error text ("" when none)."""
        return "; ".join(f"{n} from {address} (last: {reason})" for address, (n, reason) in sorted(self.totals.items()))
