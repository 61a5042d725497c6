"""``SmallChannel``: small collectives between the ranks of one host through shared memory.

Every rank has a slot in a segment that all of them map. One operation is one *exchange*:
each rank writes what it contributes into its slot, then its *stamp* (``stamp(seq, sub)``:
the operation's sequence number, and which of the operation's exchanges this is), and waits
until every other rank's slot carries the same stamp; then it reads what it needs from the
others' slots. Nothing crosses the kernel when the ranks
are running: a small all_reduce is a copy in, n reads of a word, and a reduction.

Layout, int64 words (each 64-byte line is written by one rank only)::

    line 0        reserved
    line 1 + r    rank r's control: [0] sleeping on (peer + 1, 0: awake), [1] announce stamp,
                  [2] announce descriptor, [3] announce count
    then, for set p in (0, 1) and rank r: slot (p, r) = a header line [0] stamp,
                  [1] descriptor, [2] count; then SLOT bytes of payload

**Why two sets are enough.** The c-th exchange uses set c % 2. A rank that writes set p in
exchange c has finished exchange c-1, so it has seen every rank's stamp of c-1; each rank
wrote that after it had finished reading exchange c-2, the last one that used set p. So
nothing it overwrites is still being read, and no rank ever waits for a reader.

**Ordering.** A reader that sees a stamp must see the payload and descriptor written
before it: x86 keeps stores in program order and loads in program order (TSO), so writing
the stamp last is enough. CPUs that reorder stores (ARM, POWER) would need barriers Python
cannot issue; there the channel is not used (``supported()``) and small collectives go over
TCP.

**Mismatches are detected on every rank without any frame.** The descriptor (collective,
dtype, reduce op, root, element count) is in every slot's header, and each rank checks every
peer's against its own, so two ranks in different collectives or with different shapes both
see it. A rank whose operation does not go through the channel (a large array, another
collective) *announces* its descriptor and stamp in its control line first; a rank waiting
in the channel for it sees the announcement (or a stamp past its own: the peer went on
without it) and aborts the group with both descriptors. The abort travels to every rank as
an ABORT frame on the mesh, which also wakes every sleeper here.

**Failure.** A waiter checks, between spins and between sleeps, the group's error (an abort
from anywhere), the connection of the peer it waits for (a rank that died closes it), and
its deadline (the group timeout); while it sleeps, the heartbeats report what it waits for,
so a timeout names the silent rank as it does for TCP waits. All of that is the group's
``Health`` (health.py), which the channel is given, as the mesh is.
"""

from __future__ import annotations

import ctypes
import platform
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from ....deadline import Deadline
from ....errors import DistBackendError
from . import frames
from .health import Health
from .shm import SharedSegment
from .shm_wait import BLOCK_SLICE_S, FUTEX, SPIN_QUIET_S, WaitPolicy, fence, sched_yield

LINE = 64
WORD = 8
_WORDS = LINE // WORD
#: Word reads between two looks at the clock while spinning (~2 µs).
SPIN_BURST = 32
#: Typed views of the slots kept per channel (one entry per dtype and element count).
VIEW_CACHE = 32
#: Stamps number an operation's exchanges in their low bits (a large all_reduce through
#: shared memory synchronises twice per round: up to 2^19 rounds).
SUB_BITS = 20


def stamp(seq: int, sub: int = 0) -> int:
    """The stamp of exchange ``sub`` of operation ``seq`` (never 0: a fresh slot holds 0)."""
    return (seq + 1) << SUB_BITS | sub


def supported() -> bool:
    """Whether this CPU makes stores visible in program order (see Ordering above)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def bytes_needed(size: int, slot_bytes: int) -> int:
    return LINE * (1 + size) + 2 * size * (LINE + _round(slot_bytes))


def _round(nbytes: int) -> int:
    return (nbytes + LINE - 1) // LINE * LINE


def descriptor(op: int, dtype: int, redop: int, root: int) -> int:
    """One word for what an operation is (the count travels beside it)."""
    return op | dtype << 8 | redop << 16 | (root + 1) << 24


def _seq_of(stamp_: int) -> int:
    return (stamp_ >> SUB_BITS) - 1


def descriptor_fields(word: int) -> tuple:
    """(op, dtype, redop, root) of a descriptor word."""
    return word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF, (word >> 24) - 1


def _operation(word: int, count: int) -> tuple:
    """(op, dtype, redop, count, root) of a descriptor word and count (frames.agree's form)."""
    op, dtype, redop, root = descriptor_fields(word)
    return op, dtype, redop, count, root


def describe(word: int, count: int) -> str:
    op, dtype, _, root = descriptor_fields(word)
    return frames.describe(op, dtype, count, root)


class _Described:
    """An operation in a user's words, formatted only when shown (heartbeats, errors)."""

    __slots__ = ("word", "count", "stamp")

    def __init__(self, word: int, count: int, stamp: int):
        self.word, self.count, self.stamp = word, count, stamp

    def __str__(self) -> str:
        return f"{describe(self.word, self.count)} through shared memory (op #{_seq_of(self.stamp)})"


class _SharedWait:
    """What a sleeping waiter tells the mesh (heartbeats, timeout diagnosis): the shape of
    a posted receive, without a socket."""

    __slots__ = ("conn", "what", "error", "operation")
    sending = False

    def __init__(self, conn, what: _Described):
        self.conn = conn
        self.what = what
        self.error: Optional[BaseException] = None
        op, dtype, redop, _ = descriptor_fields(what.word)
        self.operation = (op, dtype, redop, _seq_of(what.stamp) & 0xFFFFFFFF, what.count)

    def fail(self, error: BaseException) -> None:
        self.error = error


class SmallChannel:
    """One group's slots on this host. ``health`` is the group's (its TCP mesh's, health.py):
    its error, its connections (to tell a dead peer), abort, heartbeats and the wake-up hooks."""

    def __init__(self, segment: SharedSegment, rank: int, size: int, slot_bytes: int, health: Health,
                 policy: WaitPolicy, timeout_s: float):
        self.segment = segment
        self.rank = rank
        self.size = size
        self.slot_bytes = slot_bytes
        self.health = health
        self.policy = policy
        self.timeout_s = timeout_s
        self.exchanges = 0
        self._spin_misses = 0
        self._spin_quiet_until = 0.0  # no spinning before this perf_counter() time
        mm = segment.mm
        assert mm is not None, "a segment is mapped until it is closed"
        self._words = memoryview(mm).cast("q")
        self._anchor: Optional[ctypes.c_char] = ctypes.c_char.from_buffer(mm)
        self._address = ctypes.addressof(self._anchor)
        self._ctl = [(1 + r) * _WORDS for r in range(size)]
        stride = LINE + _round(slot_bytes)
        first = LINE * (1 + size)
        self._slot_offset = [[first + (p * size + r) * stride for r in range(size)] for p in (0, 1)]
        self._stamp = [[offset // WORD for offset in row] for row in self._slot_offset]
        self._others = [r for r in range(size) if r != rank]
        self._views: Dict[Tuple[np.dtype, int], List[List[np.ndarray]]] = {}
        health.trouble_hooks.append(self.wake_everyone)

    # -- one exchange ----------------------------------------------------------------------------

    def next_set(self) -> int:
        """The slot set of the next exchange (0 or 1)."""
        c = self.exchanges
        self.exchanges = c + 1
        return c & 1

    def views(self, dtype: np.dtype, count: int) -> List[List[np.ndarray]]:
        """``views[p][r]``: the first ``count`` elements of slot (p, r) as ``dtype``."""
        key = (dtype, count)
        found = self._views.get(key)
        if found is None:
            if len(self._views) >= VIEW_CACHE:
                self._views.clear()
            mm = self.segment.mm
            assert mm is not None, "a segment is mapped until it is closed"
            found = [[np.frombuffer(mm, dtype, count, offset + LINE) for offset in row]
                     for row in self._slot_offset]
            self._views[key] = found
        return found

    def publish(self, p: int, stamp: int, word: int, count: int) -> None:
        """Say that this rank's slot of set ``p`` holds its part of operation ``stamp``."""
        words = self._words
        at = self._stamp[p][self.rank]
        words[at + 1] = word
        words[at + 2] = count
        words[at] = stamp
        self._wake_sleepers(at)

    def await_all(self, p: int, stamp: int, word: int, count: int, policy: Optional[WaitPolicy] = None) -> None:
        """Return when every rank's slot of set ``p`` holds operation ``stamp``; raise (and
        abort the group) if a rank is in another operation, or gone, or the deadline passes.
        ``policy``: how to wait, when not the channel's (shm_wait.LONG for waits expected to
        last milliseconds)."""
        words = self._words
        row = self._stamp[p]
        for j in self._others:
            at = row[j]
            if words[at] != stamp:
                self._wait_for(j, at, stamp, word, count, policy or self.policy)
            if words[at + 1] != word or words[at + 2] != count:  # (the rule's fast path: see _mismatch)
                self._mismatch(j, words[at + 1], words[at + 2], word, count)

    def announce(self, stamp: int, word: int, count: int) -> None:
        """This rank's operation (``stamp(seq)``) does not go through the channel: say what it
        is, so that a rank waiting here for this one learns why it does not come."""
        words = self._words
        at = self._ctl[self.rank]
        words[at + 2] = word
        words[at + 3] = count
        words[at + 1] = stamp
        fence()
        me = self.rank + 1
        for j in self._others:
            if words[self._ctl[j]] == me:
                for p in (0, 1):
                    FUTEX.wake(self._address + self._stamp[p][self.rank] * WORD)
                return

    # -- waiting ---------------------------------------------------------------------------------

    def _wake_sleepers(self, at: int) -> None:
        words = self._words
        fence()
        me = self.rank + 1
        for j in self._others:
            if words[self._ctl[j]] == me:
                FUTEX.wake(self._address + at * WORD)
                return

    def _wait_for(self, j: int, at: int, stamp: int, word: int, count: int, policy: WaitPolicy) -> None:
        words = self._words
        clock = time.perf_counter
        start = clock()
        if policy.spin_s and start >= self._spin_quiet_until:
            spin_end = start + policy.spin_s
            while True:
                for _ in range(SPIN_BURST):
                    if words[at] == stamp:
                        self._spin_misses = 0
                        return
                if clock() >= spin_end:
                    break
            # The peer did not come within the window: something else has its CPU (or it is
            # busy). Spinning again right away would take a CPU from it; back off, longer
            # after each miss in a row (SPIN_QUIET_S x 2^k, k <= 10).
            misses = self._spin_misses = min(self._spin_misses + 1, 10)
            self._spin_quiet_until = clock() + SPIN_QUIET_S * (1 << misses)
        self._check_peer(j, at, stamp, word, count)
        yield_end = start + policy.spin_s + policy.yield_s
        checks = 0
        while clock() < yield_end:
            sched_yield()
            if words[at] == stamp:
                return
            checks += 1
            if checks & 15 == 0:
                self._check_peer(j, at, stamp, word, count)
        self._block(j, at, stamp, word, count)

    def _block(self, j: int, at: int, stamp: int, word: int, count: int) -> None:
        """Sleep on peer ``j``'s stamp until it is ``stamp``, in slices."""
        words = self._words
        health = self.health
        flag = self._ctl[self.rank]
        address = self._address + at * WORD
        deadline = Deadline(self.timeout_s)
        wait = _SharedWait(health.conns[j], _Described(word, count, stamp))
        key = health.begin_wait(wait)  # while this thread sleeps, the progress thread reads the connections
        try:
            while True:
                words[flag] = j + 1
                fence()
                seen = words[at]
                if seen == stamp:
                    return
                self._check_peer(j, at, stamp, word, count)
                left = deadline.remaining()
                if left <= 0:
                    raise health.wait_timed_out(wait, deadline)
                FUTEX.wait(address, seen, min(BLOCK_SLICE_S, left))
                words[flag] = 0
                if words[at] == stamp:
                    return
                health.beat()
        finally:
            words[flag] = 0
            health.end_wait(key)

    def _check_peer(self, j: int, at: int, stamp: int, word: int, count: int) -> None:
        """Raise if peer ``j`` cannot bring ``stamp``: the group failed, ``j`` is gone, or ``j``
        is in (or past) another operation."""
        health = self.health
        if health.error is not None:
            raise health.error
        words = self._words
        ctl = self._ctl[j]
        announced = words[ctl + 1]
        seen = words[at]
        if seen == stamp:
            return
        first = stamp >> SUB_BITS << SUB_BITS  # the operation's own announcement would carry this
        if announced == first:
            self._mismatch(j, words[ctl + 2], words[ctl + 3], word, count)
        if announced > first or seen > stamp:
            error = DistBackendError(
                f"{health.label}: mismatched collective: rank {j} went on past operation #{_seq_of(stamp)} without "
                f"taking part in this rank's {describe(word, count)}: the ranks called different collectives "
                f"(or the same ones in a different order), or passed arrays of different sizes")
            raise health.abort(error)
        health.check_peer(j)

    def _mismatch(self, j: int, their_word: int, their_count: int, word: int, count: int) -> None:
        """Abort the group: rank ``j`` is in another operation than this rank's (a descriptor
        word and count that are not this rank's: the channel carries no all_to_all, so two
        ranks agree (frames.agree) exactly when both are equal)."""
        error = DistBackendError(f"{self.health.label}: " + frames.disagreement(
            f"rank {j}", _operation(their_word, their_count), _operation(word, count), verb="is in"))
        raise self.health.abort(error)

    def wake_everyone(self) -> None:
        """Wake every sleeper on every stamp (the group failed or a peer is gone)."""
        if self.segment.mm is None:
            return
        for row in self._stamp:
            for at in row:
                FUTEX.wake(self._address + at * WORD)

    # -- teardown --------------------------------------------------------------------------------

    def close(self) -> None:
        try:
            self.health.trouble_hooks.remove(self.wake_everyone)
        except ValueError:
            pass
        self._views.clear()
        self._words.release()
        self._anchor = None
        self.segment.close()
