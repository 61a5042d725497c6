"""``Health``: whether a group's ranks are alive and in step, and what happens when they are not.

One object per mesh, passed explicitly to the mesh (tcp.py) and to the same-host
shared-memory channel (shm_channel.py), which both wait on peers:

* **Waits and heartbeats:** a thread about to block on a peer registers its wait
  (``begin_wait``: a posted receive, a send the peer does not read, a wait in shared memory);
  while any wait lasts, every peer is told every HEARTBEAT_INTERVAL what this rank waits for
  (``beat``), so a rank that times out can tell a peer that is alive (and waiting on somebody
  else) from one that has gone silent.
* **Diagnosis:** a wait that times out says whether the awaited rank is alive (and waiting on
  whom) and which ranks have gone silent — in a ring every rank waits on a neighbour, so naming
  only the awaited one would usually blame an innocent rank.
* **Failure:** a lost peer fails what waits on it (``peer_lost``); ``abort`` sends an ABORT
  frame with the reason to every peer and fails every pending and later operation with it.
* **Hooks:** ``failure_hooks`` are called with the group's error the moment it fails, before
  any thread can see the failure (whoever keeps the group's state, the router, knows it before
  the first operation raises it). ``trouble_hooks`` are called when the group fails, a peer is lost, or the mesh
  closes: waiters that sleep on something else than a socket (shared memory) must be woken to
  look at the news. ``before_sleep`` is called when a thread begins a wait: the mesh hands the
  connections that waiting threads have read back to its progress thread then (progress.py).
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ....deadline import Deadline, format_duration
from ....errors import DistBackendError
from . import frames
from .connection import PeerConnection
from .frames import ABORT, HEARTBEAT
from .matching import Matching

#: The mesh's one logger (users filter on its name), shared by its modules.
log = logging.getLogger("distlib.transport.tcp")

#: A rank blocked in a wait tells its peers what it waits for this often; a peer not heard
#: from for SILENT_AFTER seconds while others wait is reported as the likely culprit.
HEARTBEAT_INTERVAL = 2.0
SILENT_AFTER = 3 * HEARTBEAT_INTERVAL


class BlockedSend:
    """A send that waits for the peer to read (its TCP window is closed): listed among the
    waits a heartbeat reports, as receives are."""

    __slots__ = ("conn", "what")
    sending = True

    def __init__(self, conn: PeerConnection, what: object):
        self.conn = conn
        self.what = what


class Health:
    """The liveness and failure state of one mesh: rank ``rank`` of the group ``label``,
    whose connections are ``conns`` (the mesh's list, indexed by peer; filled as they are
    made) and whose receives ``matching`` holds.

    A wait (``begin_wait``) is anything with ``conn`` (the awaited peer's PeerConnection or
    None), ``what`` (what it waits for, in a user's words), ``sending`` (True for a send the
    peer does not read), ``fail(error)`` and, optionally, ``operation`` ((op, dtype, redop,
    seq, count) of the collective it waits in, or None)."""

    def __init__(self, rank: int, label: str, conns: List[Optional[PeerConnection]], matching: Matching):
        self.rank = rank
        self.label = label
        self.conns = conns
        self.matching = matching
        #: Why the group failed (or that it was destroyed); None while it works.
        self.error: Optional[DistBackendError] = None
        #: What threads are blocked on, by key, with the time they began
        self.waits: Dict[int, Tuple[Any, float]] = {}  # a Slot or a BlockedSend (conn, sending, what)
        self._last_beat = 0.0
        #: Called (no arguments) when the group fails, a peer's connection is lost, or the mesh
        #: closes: see the module's docstring.
        self.trouble_hooks: List[Callable[[], None]] = []
        #: Called with the group's error when it fails (abort, or an ABORT from a peer), before
        #: ``error`` is set: see the module's docstring.
        self.failure_hooks: List[Callable[[DistBackendError], None]] = []
        #: Called (no arguments) when a thread begins a wait (see begin_wait).
        self.before_sleep: Callable[[], None] = lambda: None

    def on_failure(self, hook: Callable[[DistBackendError], None]) -> None:
        """Call ``hook`` with the group's error when it fails, or now if it has already: a peer
        may abort the group before this rank has finished setting it up."""
        with self.matching.lock:
            self.failure_hooks.append(hook)
            if self.error is not None:
                hook(self.error)

    # -- waits and heartbeats --------------------------------------------------------------------

    def register(self, wait) -> int:
        """Register a wait on a peer (see the class): the heartbeats report it. Returns the
        key for end_wait."""
        key = id(wait)
        self.waits[key] = (wait, time.monotonic())
        return key

    def begin_wait(self, wait) -> int:
        """register, for a thread about to block: ``before_sleep`` runs."""
        key = self.register(wait)
        self.before_sleep()
        return key

    def end_wait(self, key: int) -> None:
        self.waits.pop(key, None)

    def beat(self) -> None:
        """Tell every peer what this rank has been waiting for (if for a while).

        Called by the progress thread and by every thread that waits (receiving, or sending
        to a peer that does not read, or in shared memory), at most once per
        HEARTBEAT_INTERVAL in all: any one of them may be the thread that is stuck (the
        progress thread in the middle of a frame from a peer that was cut off), and the rank
        must not fall silent because of it.
        """
        now = time.monotonic()
        if now - self._last_beat < HEARTBEAT_INTERVAL:
            return
        oldest = min(list(self.waits.values()), key=lambda item: item[1], default=None)
        if oldest is None or now - oldest[1] < HEARTBEAT_INTERVAL:
            return
        self._last_beat = now
        slot, since = oldest
        who = slot.conn.name() if slot.conn is not None else "any rank"
        if slot.sending:
            data = f"waiting {now - since:.0f}s to send {slot.what} to {who} (it is not reading)".encode("utf-8")
        else:
            data = f"waiting {now - since:.0f}s for {slot.what} from {who}".encode("utf-8")
        op, dtype, redop, seq, count = getattr(slot, "operation", None) or (0, 0, 0, 0, 0)
        frame = frames.pack(HEARTBEAT, op, dtype, redop, seq, 0, count, len(data)) + data
        for conn in self.conns:
            if conn is None or conn.failed is not None or not conn.send_lock.acquire(blocking=False):
                continue
            try:
                if conn.leftover:
                    continue  # the last one is still not out: the peer is not reading
                try:
                    sent = conn.sock.send(frame, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    continue
                if 0 < sent < len(frame):
                    conn.leftover = frame[sent:]
            finally:
                conn.send_lock.release()

    def heard(self, conn: PeerConnection, status: str) -> None:
        """``conn``'s peer sent a heartbeat saying what it waits for."""
        conn.status = status
        conn.status_time = conn.last_heard

    # -- diagnosis -------------------------------------------------------------------------------

    def give_up(self, wait, deadline: Deadline) -> None:
        """``wait``'s deadline passed: fail it and abort the group, saying who is alive and who
        is silent."""
        who = wait.conn.name() if wait.conn is not None else "any rank"
        error = DistBackendError(
            f"{self.label}: rank {self.rank} timed out after {format_duration(deadline.seconds)} waiting for "
            f"{wait.what} from {who}. {self.diagnose(wait)} The group is aborted; destroy it and init again")
        wait.fail(self.abort(error))

    def wait_timed_out(self, wait, deadline: Deadline) -> DistBackendError:
        """The error of a registered wait whose deadline passed (give_up); the group is
        aborted with it."""
        self.give_up(wait, deadline)
        return wait.error

    def diagnose(self, wait) -> str:
        """Who is alive (and waiting on whom) and who has gone silent, from the heartbeats."""
        now = time.monotonic()
        parts = []
        awaited = wait.conn
        if awaited is not None:
            if awaited.status and now - awaited.status_time < SILENT_AFTER:
                parts.append(f"{awaited.name()} is alive: it is {awaited.status}.")
            else:
                parts.append(f"{awaited.name()} has been silent for {now - awaited.last_heard:.0f}s.")
        silent = [c for c in self.conns if c is not None and c.failed is None and now - c.last_heard > SILENT_AFTER]
        if silent:
            names = ", ".join(f"{c.name()} for {now - c.last_heard:.0f}s" for c in silent)
            parts.append(f"Silent: {names} — likely cut off from the network, stopped, or stuck outside "
                         f"distlib (the ranks that are waiting say so every {HEARTBEAT_INTERVAL:.0f}s).")
        return " ".join(parts) or "That rank is slow, stuck in another operation, or unreachable."

    def timeout(self, conn: PeerConnection, doing: str, deadline: Deadline) -> DistBackendError:
        """A deadline passed while ``doing`` something with ``conn``'s peer: the group is aborted."""
        error = DistBackendError(
            f"{self.label}: rank {self.rank} timed out after {format_duration(deadline.seconds)} {doing} "
            f"with {conn.name()}")
        return self.abort(error)

    # -- failure ---------------------------------------------------------------------------------

    def check(self, conn: PeerConnection) -> None:
        """Raise if the group failed or ``conn`` is gone (aborting the group: an operation needs
        that peer)."""
        if self.error is not None:
            raise self.error
        if conn.failed is not None:
            raise self.abort(conn.failed)  # an operation needs a peer that is gone: it fails for all

    def check_peer(self, peer: int) -> None:
        """check, for rank ``peer`` (no connection yet: only the group's error)."""
        if self.error is not None:
            raise self.error
        conn = self.conns[peer]
        if conn is not None and conn.failed is not None:
            self.check(conn)

    def peer_lost(self, conn: PeerConnection, doing: str, exc: Optional[OSError]) -> DistBackendError:
        """The connection to one peer is gone: fail what waits on it (not the whole group: a
        peer that finished and destroyed its group closes its connections while others are
        still busy with each other). An operation that needed the peer fails, and that
        failure aborts the group."""
        cause = "closed the connection" if exc is None or exc.errno in (errno.EPIPE, errno.ECONNRESET) \
            else f"connection failed ({exc.strerror})"
        error = DistBackendError(
            f"{self.label}: {conn.name()} {cause} while rank {self.rank} was {doing}: "
            f"rank {conn.peer} died, was killed, or destroyed its process group")
        error.connection_lost = True  # only that connection is gone (see Mesh.read_frame)
        with self.matching.lock:
            if conn.failed is None:
                conn.failed = error
            slots = self.matching.drain_peer(conn.peer)
        log.debug("%s", error)
        for slot in slots:
            slot.fail(conn.failed)
        self.troubled()
        return conn.failed

    def operation_failed(self, error: DistBackendError) -> DistBackendError:
        """What an operation whose receive failed raises: its own error, after telling the
        other ranks (abort), unless the group had already learnt the cause. A peer that aborts
        closes its connections, and its ABORT can arrive on another connection than the one
        whose close this rank saw first (or be lost to a reset); the cause beats the symptom."""
        if error.connection_lost and self.error is not None and not self.error.connection_lost:
            return self.error
        return self.abort(error)  # this operation failed: tell the other ranks

    def abort(self, error: DistBackendError) -> DistBackendError:
        """Tell every peer why, then fail every pending and later operation with ``error``.
        Returns the group's error, which is ``error`` unless the group had failed already
        (another rank's report can come first): what the caller raises, so that what a rank
        raises is what every later operation names (Router.refusal)."""
        self.fail_everything(error, str(error), self.rank)
        return self.error or error

    def aborted_by(self, origin: int, message: str) -> None:
        """Rank ``origin`` found the group failed, and said why (an ABORT frame)."""
        conn = self.conns[origin] if 0 <= origin < len(self.conns) else None
        reporter = conn.name() if conn is not None else f"rank {origin}"
        self.fail_everything(DistBackendError(f"{message} (reported by {reporter})"), message, origin)

    def fail_everything(self, error: DistBackendError, message: str, origin: int) -> None:
        """Fail everything with ``error`` and pass the ABORT on to every peer.

        A rank that receives an ABORT forwards it too, before it can close anything: each
        connection delivers in order, so every rank reads the original reason before it could
        see any connection close because another rank gave up (the reason, not a symptom)."""
        with self.matching.lock:
            if self.error is not None:
                return
            for hook in self.failure_hooks:  # before ``error``: whoever sees it finds the hooks' state set
                hook(error)
            self.error = error
            slots = self.matching.drain_all()
        log.error("%s: aborting: %s", self.label, error)
        data = message.encode("utf-8")
        frame = frames.pack(ABORT, 0, 0, 0, origin, 0, 0, len(data)) + data
        for conn in self.conns:
            if conn is None or conn.failed is not None or conn.peer == origin:
                continue
            try:
                if conn.send_lock.acquire(timeout=0.5):
                    try:
                        conn.sock.send(frame)
                    finally:
                        conn.send_lock.release()
            except OSError:
                pass
        for slot in slots:
            slot.fail(error)
        self.troubled()

    def destroyed(self) -> None:
        """The mesh closed: every later operation fails, saying so."""
        with self.matching.lock:
            if self.error is None:
                self.error = DistBackendError(f"{self.label}: the process group was destroyed")
            self.matching.settled = True
        self.troubled()

    def troubled(self) -> None:
        for hook in list(self.trouble_hooks):
            try:
                hook()
            except Exception:  # noqa: BLE001 - a hook must not stop the failure from spreading
                log.exception("%s: a wake-up hook failed", self.label)
