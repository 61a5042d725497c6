"""How replies go out: at the end of each loop turn, one send per connection; what the kernel
does not take waits (backpressure), counted against the memory budget.

``ReplySender`` is one object of the server (server.py), given what it uses: the epoll
object, the memory budget, the batch path (its helper threads send large turns) and three
calls back to the server: ``close`` a connection whose send failed, ``enforce_budget`` after
unsent replies grew, and ``on_drained`` when a paused connection may run and read again.

* **Replies go out at the end of the loop turn**, one send per connection, the replies a
  connection's own requests produced and the wake-ups other requests caused alike
  (``_flush`` says why).
* **Backpressure.** A connection whose replies the kernel did not take is not read again
  (its requests wait in the kernel) until they are sent. Large values go out by reference to
  the stored object (handlers.py), sent with sendmsg, never joined into a copy; the server's
  own bytes among the unsent replies count against its memory budget.
"""

from __future__ import annotations

import collections
import errno
from itertools import islice
from typing import Callable, Deque, List, Optional

from .batch import BatchPath
from .budget import MemoryBudget
from .connection import CONN_EVENTS, IOV_MAX, PAUSED_EVENTS, Connection

#: A turn with at least this many connections to answer sends through batch.send_replies.
FLUSH_BATCH_MIN = 16


class ReplySender:
    """Sending the replies of a store server's connections."""

    def __init__(self, ep, budget: MemoryBudget, batch: Optional[BatchPath],
                 close: Callable[[Connection, str], None], enforce_budget: Callable[[], None],
                 on_drained: Callable[[Connection], None]):
        self.ep = ep
        self.budget = budget
        self.batch = batch
        self.close = close
        self.enforce_budget = enforce_budget
        self.on_drained = on_drained

    def flush(self, answered: List[Connection]) -> None:
        """Send every reply this loop turn produced (the connections ``answered`` lists, which
        is emptied), one send per connection.

        Replies go out at the end of the turn, not right after each read: a client process
        with many connections (a load generator, a proxy) then finds a burst of replies when
        it wakes, instead of being woken once per reply. A single client's request is the
        only event of its turn, so it waits for nothing.
        """
        dirty = answered
        if self.batch is not None and len(dirty) >= FLUSH_BATCH_MIN:
            dirty = self._flush_batch(dirty)
        for conn in dirty:
            out = conn.out
            if not out:
                continue  # listed twice this turn, or closed
            if len(out) == 1 and conn.pending is None:  # the usual case: one reply, sent whole
                reply = out[0]
                try:
                    sent = conn.sock.send(reply)
                except OSError:
                    sent = None  # _send tries again, and handles the full buffer or the error
                if sent == len(reply):
                    out.clear()
                    continue
                if sent is not None:  # the kernel took part of it
                    conn.out = []
                    self._send_parts(conn, out, sent)
                    continue
            self._send(conn)
        answered.clear()  # (sending adds nobody to it)

    def _flush_batch(self, dirty: List[Connection]) -> List[Connection]:
        """Send the single replies of a large turn with ``batch.send_replies``; return the
        connections left for ``_flush``'s general path (more than one reply, output already
        pending, a TLS connection, or a send that did not take all)."""
        conns: List[Connection] = []
        replies: List[bytes] = []
        rest: List[Connection] = []
        for conn in dirty:
            out = conn.out
            if len(out) == 1 and conn.pending is None and not conn.tls:
                conns.append(conn)
                replies.append(out.pop())
            elif out:  # (empty: listed twice this turn, or closed)
                rest.append(conn)
        assert self.batch is not None, "flush() takes this path only with the batch path"
        rest += self.batch.send_replies(conns, replies)
        return rest

    def _send(self, conn: Connection) -> None:
        """Send ``conn.out``, joined into one send (the usual case: small parts, cheaper than
        sendmsg); the rest is ``_send_parts``."""
        out = conn.out
        conn.out = []
        if conn.pending is None and not conn.refs:
            data = out[0] if len(out) == 1 else b"".join(out)
            try:
                sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self.close(conn, _send_failure(exc))
                return
            if sent == len(data):
                if conn.paused:  # it stopped running requests to let these out: go on
                    conn.paused = False
                    self.on_drained(conn)
                return
            out = [data]
        else:
            sent = None
        self._send_parts(conn, out, sent)

    def _send_parts(self, conn: Connection, out: List[bytes], sent: Optional[int]) -> None:
        """Send ``out`` with sendmsg, the stored values it carries by reference not copied
        (``sent``: bytes of it a send already took); what the kernel does not take waits in
        ``conn.pending``, and the connection is not read until it is out (backpressure)."""
        conn.refs = False
        if conn.pending is not None:
            conn.pending.extend(out)
            own = _own_bytes(out)
            conn.pending_own += own
            self.budget.charge(conn, own)
            self.enforce_budget()
            return
        total = sum(map(len, out))
        if sent is None:
            try:
                sent = conn.sock.send(out[0]) if len(out) == 1 else conn.sock.sendmsg(out[:IOV_MAX])
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self.close(conn, _send_failure(exc))
                return
        if sent == total:
            if conn.paused:
                conn.paused = False
                self.on_drained(conn)
            return
        conn.pending_own = _own_bytes(out)  # (counted whole until all is out)
        self.budget.charge(conn, conn.pending_own)
        pending = collections.deque(out)
        _drop_front(pending, sent)
        conn.pending = pending
        conn.paused = True
        self.ep.modify(conn.fd, PAUSED_EVENTS)
        self.flush_pending(conn)  # more than IOV_MAX parts: the socket may take more
        if not conn.closed:
            self.enforce_budget()

    def flush_pending(self, conn: Connection) -> None:
        """Send what waits in ``conn.pending``; when all is out, read the connection again."""
        pending = conn.pending
        if pending is None:
            return
        sock = conn.sock
        while pending:
            parts = list(islice(pending, IOV_MAX))
            try:
                sent = sock.send(parts[0]) if len(parts) == 1 else sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.close(conn, _send_failure(exc))
                return
            _drop_front(pending, sent)  # (a partial send is not "full": TLS takes 256 KiB a call)
        conn.pending = None
        self.budget.charge(conn, -conn.pending_own)
        conn.pending_own = 0
        self.ep.modify(conn.fd, CONN_EVENTS)
        if conn.paused:
            conn.paused = False
            self.on_drained(conn)



def _own_bytes(parts) -> int:
    """The bytes of ``parts`` the server allocated: all but the stored values that replies
    carry by reference (memoryviews, handlers.py)."""
    return sum([len(p) for p in parts if p.__class__ is not memoryview])


def _drop_front(parts: Deque, n: int) -> None:
    """Remove ``n`` sent bytes from the front of ``parts``."""
    while n:
        head = parts[0]
        size = len(head)
        if n < size:
            parts[0] = memoryview(head)[n:]
            return
        parts.popleft()
        n -= size


def _send_failure(exc: OSError) -> str:
    """The reason a failed send closes a connection, for the log."""
    return "disconnected" if exc.errno in (errno.EPIPE, errno.ECONNRESET) else f"send failed ({exc.strerror})"
