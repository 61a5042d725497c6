"""``Matching``: a mesh's posted receives, and the frames that arrived before theirs.

A receive is *posted* (a ``Slot``: where the payload goes and what the frame must look
like) and an incoming frame is matched to it: a collective's DATA frame by ``(seq, step)``
from its peer, a point-to-point frame first-in-first-out per (peer, tag), a receive from
any source by tag. A frame whose receive is not posted yet is *kept* with its payload until
it is. No sockets here: the mesh (tcp.py) reads the frames and hands their headers and
payloads in, so tests drive the matching by calling it.

It also knows which collective this rank is in (``begin``), so a frame that no receive took
is checked against it (frames.agree): ranks whose algorithm never sends them a frame from
the odd rank out still learn of a mismatch from those that do.

Every table is guarded by ``lock``. The mesh's health (health.py) takes it to set the
group's error and empty the tables at once (``drain_all``), and the mesh to mark a peer
lost and take its receives (``drain_peer``): a receive is never posted on a connection that
is gone, nor after the group failed.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ....errors import DistBackendError

from . import frames
from .frames import DATA, agree, disagreement

#: What ``post_data`` and ``post_p2p`` return when the peer's connection is gone (nothing posted).
LOST = ("lost",)
#: A frame kept for a later receive: its header fields (frames.unpack) and its payload.
Kept = Tuple[tuple, bytearray]

_MONITORED_BARRIER = frames.OPS["monitored_barrier"]


class Slot:
    """A posted receive: where the payload goes and what the frame must look like."""

    sending = False  # see health.BlockedSend

    __slots__ = ("view", "kind", "op", "dtype", "redop", "nbytes", "count", "what",
                 "event", "done", "error", "source", "conn", "seq")

    def __init__(self, view: memoryview, kind: int, op: int, dtype: int, redop: int, count: int, what: object,
                 seq: int = -1):
        self.view = view
        self.kind = kind
        self.op = op
        self.dtype = dtype
        self.redop = redop
        self.nbytes = view.nbytes
        self.count = count
        self.what = what  # a str, or an object formatted only when shown (algorithms.context.Label)
        self.seq = seq  # the operation's number (DATA), for heartbeats
        self.event = threading.Event()
        self.done = False
        self.error: Optional[DistBackendError] = None
        self.source = -1
        #: The peer's connection (anything with ``name()`` and ``peer``); None while a
        #: receive from any source has not matched.
        self.conn: Any = None

    @property
    def operation(self) -> Optional[Tuple[int, int, int, int, int]]:
        """(op, dtype, redop, seq, count) of the collective this receive belongs to (heartbeats)."""
        return (self.op, self.dtype, self.redop, self.seq & 0xFFFFFFFF, self.count) if self.seq >= 0 else None

    def complete(self, source: int) -> None:
        self.source = source
        self.done = True
        self.event.set()

    def fail(self, error: DistBackendError) -> None:
        if not self.done:
            self.error = error
            self.done = True
            self.event.set()

    def mismatch(self, op: int, dtype: int, redop: int, nbytes: int, count: int, peer: str) -> Optional[str]:
        """Why a frame cannot fill this slot, in a user's words, or None."""
        theirs, mine = (op, dtype, redop, count), (self.op, self.dtype, self.redop, self.count)
        if nbytes == self.nbytes and agree(theirs, mine):
            return None
        return disagreement(peer, theirs, mine,
                            f" ({nbytes} bytes sent, {self.nbytes} expected)" if nbytes != self.nbytes else "")


def behind(seq: int, current: int) -> bool:
    """Whether operation number ``seq`` (32 bits, wrapping) comes before ``current``."""
    return 0 < ((current - seq) & 0xFFFFFFFF) < (1 << 31)


class _Peer:
    """The tables of one peer."""

    __slots__ = ("posted", "kept", "p2p_posted", "p2p_kept", "lost")

    def __init__(self):
        self.posted: Dict[Tuple[int, int], Slot] = {}
        self.kept: Dict[Tuple[int, int], Kept] = {}
        self.p2p_posted: Dict[int, Deque[Slot]] = collections.defaultdict(collections.deque)
        self.p2p_kept: Dict[int, Deque[Kept]] = collections.defaultdict(collections.deque)
        self.lost = False

    def drain(self) -> List[Slot]:
        slots = list(self.posted.values())
        self.posted.clear()
        for queue in self.p2p_posted.values():
            slots.extend(queue)
        self.p2p_posted.clear()
        return slots


class Matching:
    """The receives of one mesh of ``size`` ranks; ``name(peer)`` says who a peer is in
    errors (``rank 1 (host:port)``)."""

    def __init__(self, size: int, name: Callable[[int], str]):
        self.lock = threading.Lock()
        self._name = name
        self._peers = [_Peer() for _ in range(size)]
        self._any_p2p: Dict[int, Deque[Slot]] = collections.defaultdict(collections.deque)
        #: (seq, op, dtype, redop, count) of the operation this rank is in (see begin)
        self.current: Optional[Tuple[int, int, int, int, int]] = None
        #: The group failed or closed: frames are no longer checked against ``current``.
        self.settled = False

    # -- the operation this rank is in ---------------------------------------------------------

    def begin(self, seq: int, op: int, dtype: int, redop: int, count: int) -> Optional[str]:
        """This rank starts collective ``seq``. From now on any DATA frame of ``seq`` that
        describes another operation, and any of an earlier ``seq`` (this rank is done with
        it: nobody should still send it anything), is a mismatch, whatever step it is for and
        whether or not its receive is posted. Returns why a frame kept before this call
        contradicts it, or None."""
        current = (seq & 0xFFFFFFFF, op, dtype, redop, count)
        with self.lock:
            self.current = current
            for peer, tables in enumerate(self._peers):
                for fields, _ in tables.kept.values():
                    problem = self._against_current(peer, fields)
                    if problem:
                        return problem
        return None

    def _against_current(self, peer: int, fields: tuple) -> Optional[str]:
        """Why a DATA frame that no posted receive took contradicts the operation this rank
        is in (or has finished), or None. Call with the lock held."""
        current = self.current
        if current is None or self.settled:
            return None
        _, op, dtype, redop, seq, _, count, _ = fields
        mine = current[1:]
        if seq == current[0]:
            theirs = (op, dtype, redop, count)
            return None if agree(theirs, mine) else disagreement(self._name(peer), theirs, mine)
        if behind(seq, current[0]) and op != _MONITORED_BARRIER:  # a late arrival may follow a give-up
            return (f"mismatched collective: {self._name(peer)} sent {frames.describe(op, dtype, count)} for "
                    f"operation #{seq}, which this rank finished without it (it is in operation #{current[0]}, "
                    f"{frames.describe(mine[0], mine[1], mine[3])}): the ranks called different collectives "
                    f"(or the same ones in a different order)")
        return None

    def waiting_in(self, peer: int, fields: tuple) -> Optional[str]:
        """A heartbeat's header from ``peer``, blocked in collective ``seq``: if this rank is
        in the same collective number but another collective, neither may ever send the other
        a frame (each waits on a third rank, or on the other): why, or None."""
        _, op, dtype, redop, seq, _, count, _ = fields
        current = self.current
        if current is None or seq != current[0]:
            return None
        theirs, mine = (op, dtype, redop, count), current[1:]
        return None if agree(theirs, mine) else disagreement(self._name(peer), theirs, mine, verb="is waiting in")

    # -- posting ---------------------------------------------------------------------------------

    def post_data(self, peer: int, seq: int, step: int, slot: Slot):
        """Post ``slot`` for the DATA frame ``(seq, step)`` from ``peer``. Returns None when
        posted, the kept frame (fields, payload) when it arrived already (the caller fills the
        slot from it: data that arrived is good even if the peer has since closed), or LOST
        when the peer's connection is gone."""
        key = (seq & 0xFFFFFFFF, step & 0xFFFFFFFF)
        tables = self._peers[peer]
        with self.lock:
            kept = tables.kept.pop(key, None)
            if kept is not None:
                return kept
            if tables.lost:
                return LOST
            tables.posted[key] = slot
            return None

    def post_p2p(self, peer: Optional[int], tag: int, slot: Slot):
        """Post ``slot`` for a point-to-point frame with ``tag`` from ``peer`` (None: any
        source). Returns None when posted, ``(source, kept frame)`` when one arrived already,
        or LOST when the peer's connection is gone."""
        tag &= 0xFFFFFFFF
        with self.lock:
            if peer is None:
                for source, tables in enumerate(self._peers):
                    if tables.p2p_kept.get(tag):
                        return source, tables.p2p_kept[tag].popleft()
                self._any_p2p[tag].append(slot)
                return None
            tables = self._peers[peer]
            queue = tables.p2p_kept.get(tag)
            if queue:
                return peer, queue.popleft()
            if tables.lost:
                return LOST
            tables.p2p_posted[tag].append(slot)
            return None

    def withdraw(self, peer: int, slot: Slot) -> bool:
        """Take a posted DATA receive back (its deadline passed); False if a frame took it."""
        tables = self._peers[peer]
        with self.lock:
            for key, posted in list(tables.posted.items()):
                if posted is slot:
                    del tables.posted[key]
                    return True
        return False

    # -- arriving --------------------------------------------------------------------------------

    def take(self, peer: int, kind: int, seq: int, step: int) -> Optional[Slot]:
        """The posted receive a frame from ``peer`` fills (taken out of the tables), or None."""
        with self.lock:
            return self._take(peer, kind, seq, step)

    def _take(self, peer: int, kind: int, seq: int, step: int) -> Optional[Slot]:
        tables = self._peers[peer]
        if kind == DATA:
            return tables.posted.pop((seq, step), None)
        queue = tables.p2p_posted.get(seq)
        if queue:
            return queue.popleft()
        queue = self._any_p2p.get(seq)
        if queue:
            return queue.popleft()
        return None

    def arrive(self, peer: int, fields: tuple, data: bytearray) -> Tuple[Optional[Slot], Optional[str]]:
        """A whole frame (header ``fields``, payload ``data``) from ``peer``: the posted
        receive it fills (taken out of the tables), or (None, None) when it is kept for a
        later one, or (None, why) when it contradicts the operation this rank is in."""
        kind, _, _, _, seq, step, _, _ = fields
        with self.lock:
            slot = self._take(peer, kind, seq, step)
            if slot is not None:
                return slot, None
            tables = self._peers[peer]
            if kind == DATA:
                problem = self._against_current(peer, fields)
                if problem:
                    return None, problem
                tables.kept[(seq, step)] = (fields, data)
            else:
                tables.p2p_kept[seq].append((fields, data))
        return None, None

    # -- failure (the caller holds the lock) -----------------------------------------------------

    def drain_peer(self, peer: int) -> List[Slot]:
        """``peer``'s connection is gone: its posted receives, taken out; nothing is posted
        for it from now on (frames it sent before are still matched)."""
        tables = self._peers[peer]
        tables.lost = True
        return tables.drain()

    def drain_all(self) -> List[Slot]:
        """The group failed: every posted receive, taken out."""
        self.settled = True
        slots: List[Slot] = []
        for tables in self._peers:
            slots.extend(tables.drain())
        for queue in self._any_p2p.values():
            slots.extend(queue)
        self._any_p2p.clear()
        return slots
