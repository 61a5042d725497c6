"""How a rank waits for a word in shared memory that another rank of its host will write.

Three stages, and which of them a rank uses is decided once, from the machine
(``decide(ranks_here, cpus)``), not by a variable:

1. **spin** briefly: read the word in a loop. Pays when the writer runs on another CPU at
   the same time: the word changes within a microsecond or two, and sleeping would cost a
   wake-up (~100 µs on a VM whose idle vCPUs halt). Only when every rank of the host has
   a CPU.
2. **yield** (``sched_yield``) between reads: free when nothing else wants the CPU, and
   when ranks outnumber CPUs (or other jobs share the machine) the writer is often waiting
   for this very CPU; yielding hands it over at once, without going to sleep.
3. **block** in the kernel (a futex on the word), in slices, so that the caller can check
   its deadline and its peers' health between them. A writer wakes sleepers only when a
   sleeper has said so (one flag per rank), so a write costs no system call when nobody
   sleeps.

The futex needs the address of the word (ctypes); where ctypes or the futex system call is
missing, blocking is a sleep that doubles up to SLEEP_MAX_S. Ordering (see ``fence``): a
waiter sets its flag, then reads the word (the kernel's futex re-reads it after a full
barrier); a writer writes the word, then a full barrier, then reads the flags. Without the
writer's barrier a flag set at that moment could be missed (x86 lets a load pass an earlier
store), and the sleeper would wait for the end of its slice.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from typing import Optional

#: Spin this long before yielding, when every rank of the host has a CPU: the peers of a
#: small collective that are running arrive within microseconds of each other. Longer
#: spins lose as soon as anything else runs on the machine (bench/performance-log.md,
#: 2026-11-24), and the channel stops spinning for a while after each miss.
SPIN_S = 10e-6
#: Yield this long before blocking. ``sched_yield`` returns at once when nothing else wants
#: the CPU (about 0.5 us here, so a yielding waiter still sees the word within a
#: microsecond) and hands the CPU over when something does, which is how it gets to the
#: rank that must write the word when ranks outnumber CPUs. Blocking costs a system call
#: on each side and a wake-up, so it is for long waits (a peer still computing).
YIELD_S = 500e-6
YIELD_CROWDED_S = 2e-3
#: After a spin that missed, no spinning for this long x 2^(misses in a row, at most 10).
SPIN_QUIET_S = 50e-6
#: Longest sleep in the kernel before the waiter looks at its deadline and peers again.
BLOCK_SLICE_S = 0.05
#: Without a futex: the first and the longest sleep between two reads of the word.
SLEEP_MIN_S = 20e-6
SLEEP_MAX_S = 1e-3

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())


class WaitPolicy:
    """How long to spin and to yield before blocking (seconds)."""

    __slots__ = ("spin_s", "yield_s")

    def __init__(self, spin_s: float, yield_s: float):
        self.spin_s = spin_s
        self.yield_s = yield_s

    def __repr__(self) -> str:
        return f"WaitPolicy(spin {self.spin_s * 1e6:.0f} us, yield {self.yield_s * 1e6:.0f} us, then block)"

    def __eq__(self, other) -> bool:
        return isinstance(other, WaitPolicy) and (self.spin_s, self.yield_s) == (other.spin_s, other.yield_s)


#: For waits that last milliseconds (the barriers of a large all_reduce through shared
#: memory, where each rank reduces megabytes in between): a rank that yields for long takes
#: CPU from the ranks still reducing, so it sleeps soon (bench/performance-log.md, 2026-11-24).
LONG = WaitPolicy(0.0, 50e-6)


def decide(ranks_here: int, cpus: int) -> WaitPolicy:
    """The wait strategy for ``ranks_here`` ranks of one group on a machine where this
    process may use ``cpus`` CPUs: spin only if each rank can have a CPU of its own."""
    if ranks_here <= cpus and cpus > 1:
        return WaitPolicy(SPIN_S, YIELD_S)
    return WaitPolicy(0.0, YIELD_CROWDED_S)


_fence_lock = threading.Lock()
_take, _give = _fence_lock.acquire, _fence_lock.release


def fence() -> None:
    """A full memory barrier. Taking and releasing a lock is an atomic read-modify-write
    (a locked instruction on x86, whichever lock implementation CPython uses), which orders
    every earlier store before every later load."""
    _take()
    _give()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """futex(2) on 32-bit words of a shared mapping (not FUTEX_PRIVATE: other processes)."""

    def __init__(self) -> None:
        self._syscall = None
        if _SYS_FUTEX is None:
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            syscall = libc.syscall
        except (OSError, AttributeError):
            return
        syscall.restype = ctypes.c_long
        syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._syscall = syscall

    @property
    def available(self) -> bool:
        return self._syscall is not None

    def wait(self, address: int, expected: int, seconds: float) -> None:
        """Sleep while the 32-bit word at ``address`` holds ``expected`` (its low 32 bits),
        at most ``seconds``; returns early on a wake-up, a signal or a changed word."""
        if self._syscall is None:
            time.sleep(min(seconds, SLEEP_MAX_S))
            return
        ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
        value = expected & 0xFFFFFFFF
        if value >= 1 << 31:
            value -= 1 << 32
        self._syscall(_SYS_FUTEX, address, _FUTEX_WAIT, value, ctypes.addressof(ts), None, 0)

    def wake(self, address: int) -> None:
        """Wake every sleeper on the word at ``address``."""
        if self._syscall is not None:
            self._syscall(_SYS_FUTEX, address, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


FUTEX = Futex()


def sched_yield() -> None:
    os.sched_yield()


def description(policy: Optional[WaitPolicy]) -> str:
    """For logs: the policy and whether blocking uses a futex."""
    how = "futex" if FUTEX.available else "sleep"
    return f"{policy!r} ({how})"
