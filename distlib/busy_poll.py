"""``BusyPoll``: when to poll for a peer's answer without sleeping, and for how long.

Why poll at all: on VMs whose idle vCPUs halt, waking a thread that blocked in
``epoll_wait``/``poll``/``recv`` costs about 100 us, more than a store request or a small
collective. A peer on the same host or LAN usually answers within tens of microseconds, so
polling without sleeping for a short window saves that wake-up. The store server, every
store client and the collectives' mesh use this one policy, each with its own window:

* **The window** (``window_s``) is the caller's: how long its peer's answer usually takes.
* **Yield the CPU when it is wanted** (``yield_cpu=True``): no spinning in a process that
  may run on one CPU only (``taskset -c 0``, a one-CPU container: the peer needs that CPU,
  so spinning could only delay the answer), nor while more tasks are runnable on the
  machine than this process has CPUs (then every microsecond spent spinning is taken from
  a process with work to do, often the very peer being waited for). The runnable count is
  the 4th field of /proc/loadavg (about 2 us to read), read each time a spin would start,
  never kept: in a barrier of thousands of ranks it changes faster than any useful cache.
  The mesh does not yield (its peers are often on other hosts, and its back-off covers a
  crowded host).
* **Back off in time after misses** (``backoff=True``): when answers keep missing the
  window (an overloaded server, more ranks than cores, large transfers), spinning only
  takes CPU from the peers that would answer; after k misses in a row there is no spinning
  for ``window_s * 2**k`` (k <= ``MAX_BACKOFF_LEVEL``), and a hit starts afresh. Back-off in
  time, not in waits: a phase of quick answers after slow ones spins again within
  ``window_s * 2**MAX_BACKOFF_LEVEL`` instead of after a thousand slow waits. A server
  (``backoff=False``) spins once after each burst of requests and then blocks, so its cost
  is already bounded by one window per burst.

The caller probes in its own way (``epoll.poll(0)``, ``poll.poll(0)``, a non-blocking
``recv``); ``spin(probe)`` returns the probe's first non-empty answer, or None when the
window passed (or spinning was not allowed): then the caller blocks as it would have.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional, TypeVar

from .cpus import usable_cpus

T = TypeVar("T")

#: After this many misses in a row the quiet period stops growing (window x 1024).
MAX_BACKOFF_LEVEL = 10


class BusyPoll:
    """One caller's busy-poll state: its window, whether it yields, its back-off level."""

    __slots__ = ("window", "cpus", "yield_cpu", "backoff", "misses", "quiet_until")

    _loadavg_fd: Optional[int] = None  # /proc/loadavg, opened once per process

    def __init__(self, window_s: float, yield_cpu: bool = True, backoff: bool = False):
        self.cpus = usable_cpus()
        self.yield_cpu = yield_cpu
        self.backoff = backoff
        self.window = max(0.0, window_s) if not yield_cpu or self.cpus > 1 else 0.0
        self.misses = 0
        self.quiet_until = 0.0  # no spinning before this time.perf_counter() value

    def spin(self, probe: Callable[[], T], count_miss: bool = True) -> Optional[T]:
        """``probe()`` without sleeping until it answers something non-empty or the window
        passes; that answer, or None (also at once when spinning is not allowed now: no
        window, a back-off pause, a CPU wanted elsewhere). ``BlockingIOError`` from the probe
        counts as "nothing yet". ``count_miss=False``: a miss says nothing about the peer (a
        WAIT's answer comes when another client acts) and does not back off.

        The checks are inline, not a method of their own: this runs once per request in the
        store's client and server.
        """
        window = self.window
        if not window:
            return None
        clock = time.perf_counter
        if self.misses and clock() < self.quiet_until:
            return None
        if self.yield_cpu:
            runnable = runnable_tasks()
            if runnable is not None and runnable > self.cpus:
                return None
        until = clock() + window
        while True:
            try:
                answer = probe()
            except BlockingIOError:
                answer = None
            if answer:
                self.misses = 0
                return answer
            if clock() >= until:
                break
        if count_miss and self.backoff:
            self.misses = min(self.misses + 1, MAX_BACKOFF_LEVEL)
            self.quiet_until = clock() + window * (1 << self.misses)
        return None


def runnable_tasks() -> Optional[int]:
    """Tasks runnable right now, machine-wide (this one included); None if unknown."""
    try:
        if BusyPoll._loadavg_fd is None:
            BusyPoll._loadavg_fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        text = os.pread(BusyPoll._loadavg_fd, 128, 0)
        return int(text.split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None
