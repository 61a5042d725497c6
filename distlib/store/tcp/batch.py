"""The server's batch path: one loop turn's plain ADD and WAIT requests, run as C-level loops.

Why it exists: on a barrier of thousands of ranks (each ADDs one counter, then WAITs for one
key; torch's own store barrier has this shape), the server's time is nearly all kernel work
(recv, send, waking the clients) plus the interpreter's work per request. The general path
(``StoreServer._read_once`` and an ``_op_*`` handler per request, ``_flush`` per reply) runs
about 150 bytecodes and 4 Python calls per request. Here, the recv()s and send()s of a whole
turn are ``map`` calls over the sockets (no bytecode per socket), a request is recognised by
looking its exact bytes up in a dict of frames seen before, and what is left per request is
a short loop body. A turn with many replies to send (the release of thousands of waiters
above all) is sent by ``send_replies``: C-level loops, split across threads (``FanOut``).

Contract with server.py (what keeps the two paths one behaviour):

* ``StoreServer._turn`` offers ``run`` only turns of at least ``min_events`` events, and
  ``run`` takes a turn only when every event is a plain EPOLLIN on a connection in
  the plain state (``_PLAIN``: validated, nothing partial, nothing held, no wait, nothing
  pending, no unsent replies); otherwise it returns False and the general loop takes the turn.
* A received frame runs here only if it is exactly one complete request of a kind
  ``frame_kind`` knows (ADD on any key but the worker counter, WAIT on one key). At the
  first one that is not, that event and every later one go through the general path, in
  order, with the bytes already received: requests keep their arrival order.
* ADD runs through ``StoreServer._add_to`` (the stored value, wrap-around, waking
  waiters); counters that are not plain decimal go to the general path, which owns the
  parse errors. WAIT answers at once or registers through ``StoreServer._wait_for``, as
  ``_op_wait`` does for one key.
* Replies go where the general path puts them (``out``, then ``_flush`` at the end of the
  turn); ``_flush`` hands a large turn's single replies to ``send_replies`` and keeps
  partial sends, send errors and everything else to itself.
"""

from __future__ import annotations

import queue
import select
import socket
import threading
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from ...cpus import usable_cpus
from .protocol import I64, STOP_WAITING, U64, WORKER_COUNTER_KEY, Op

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .server import Connection, StoreServer

_ADD = int(Op.ADD)
_WAIT = int(Op.WAIT)
_u64_from = U64.unpack_from
_i64_from = I64.unpack_from
_pack_i64 = I64.pack
_STOP = bytes([STOP_WAITING])
_EPOLLIN = select.EPOLLIN

_fd_of = itemgetter(0)
_events_of = itemgetter(1)
_sock_of = attrgetter("sock")
_recv = socket.socket.recv  # the C methods, so that map() calls them without bytecode
_send = socket.socket.send
#: A connection in this state has no partial request, nothing queued behind a wait, no
#: pending wait, no unsent output and no replies produced this turn.
_plain_state = attrgetter("validated", "inbuf", "held", "wait_count", "pending", "closed", "out")
_PLAIN = (True, None, None, 0, None, False, [])

#: Turns of fewer events go through the general path. The batch path's own work per turn
#: (a few passes over the events, a frame lookup) pays off only over several requests: for a
#: single client's request it added about 0.5-1 us to a 5-10 us round trip.
MIN_EVENTS = 8
#: Threads (the loop's included) that share a large turn's socket calls, at most.
MAX_THREADS = 4
#: Frames remembered by ``frame_kind``; the cache starts over when it is full.
FRAME_CACHE_SIZE = 4096

Kind = Tuple[int, bytes, int]  # (opcode, key, ADD delta or 0)


def frame_kind(frame: bytes, max_key: int) -> Optional[Kind]:
    """(opcode, key, delta) if ``frame`` is exactly one complete ADD (not on the worker
    counter) or one single-key WAIT within the key limit; else None."""
    size = len(frame)
    if size < 17:
        return None
    op = frame[0]
    if op == _ADD:
        n = _u64_from(frame, 1)[0]
        if n > max_key or size != 17 + n:
            return None
        key = frame[9 : 9 + n]
        if key == WORKER_COUNTER_KEY:  # the master counts its workers: general path
            return None
        return _ADD, key, _i64_from(frame, 9 + n)[0]
    if op == _WAIT:
        if _u64_from(frame, 1)[0] != 1:
            return None
        n = _u64_from(frame, 9)[0]
        if n > max_key or size != 17 + n:
            return None
        return _WAIT, frame[17:], 0
    return None


class BatchPath:
    """The batch path of one StoreServer (see the module docstring)."""

    def __init__(self, server: "StoreServer"):
        self.server = server
        self.frames: Dict[bytes, Optional[Kind]] = {}
        #: ``StoreServer._turn`` offers a turn to ``run`` only if it has this many events.
        self.min_events = MIN_EVENTS
        self.helpers = min(usable_cpus(), MAX_THREADS) - 1
        self._pool: Optional[FanOut] = None

    @property
    def pool(self) -> Optional[FanOut]:
        """The helper threads, started at first use (none with one usable CPU)."""
        if self._pool is None and self.helpers > 0:
            self._pool = FanOut(self.helpers)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def kind(self, frame: bytes) -> Optional[Kind]:
        """``frame_kind``, remembered (a barrier sends the same few frames thousands of times)."""
        kind = frame_kind(frame, self.server.limits.max_key)
        if kind is not None:
            if len(self.frames) >= FRAME_CACHE_SIZE:
                self.frames.clear()
            self.frames[frame] = kind
        return kind

    def run(self, events: Sequence[Tuple[int, int]], ep, recv_size: int) -> bool:
        """Run the turn ``events`` if it may (see the module docstring); whether it did."""
        server = self.server
        n = len(events)
        conns: List["Connection"] = list(map(server.conns.get, map(_fd_of, events)))
        if None in conns:  # a listener or the wake-up pipe
            return False
        if list(map(_events_of, events)).count(_EPOLLIN) != n:
            return False
        if list(map(_plain_state, conns)).count(_PLAIN) != n:
            return False
        # One thread: recv() is cheap beside send(), and splitting it measured no faster.
        results = _recv_part(list(map(_sock_of, conns)), recv_size)

        data = server.data
        wait_for = server._wait_for
        queues = server.queues
        known = self.frames.get
        dirty = server._dirty
        done = 0
        for conn, frame in zip(conns, results):
            kind = known(frame)
            if kind is None:
                if frame.__class__ is not bytes or len(frame) >= recv_size:
                    break  # more may be waiting: the general path reads on
                kind = self.kind(frame)
                if kind is None:
                    break
            op, key, delta = kind
            if op == _ADD:
                old = data.get(key)
                if old is not None and not (old.isdigit() and len(old) < 19):
                    break  # not a plain decimal counter: _op_add parses (and rejects) it
                conn.out.append(_pack_i64(server._add_to(key, delta, "ADD")))
                dirty.append(conn)
            elif key in data or queues.get(key):
                conn.out.append(_STOP)
                dirty.append(conn)
            else:
                wait_for(conn, [key])
            done += 1

        for i in range(done, n):  # the rest, in order, through the general path
            conn = conns[i]
            if conn.closed:
                continue
            result = results[i]
            if result is None:  # not read (the recv() of an earlier socket failed)
                more = server._read_once(conn, ep, _EPOLLIN)
            elif result.__class__ is bytes:
                more = server._consume(conn, ep, _EPOLLIN, result, recv_size)
            else:
                server._recv_failed(conn, ep, result)
                more = False
            if more:
                server._on_readable(conn, ep, _EPOLLIN)
        return True


#: A fan-out of at least this many replies is split across the threads (FanOut).
PARALLEL_MIN = 256


class FanOut:
    """Helper threads that share a large fan-out's send()s with the loop thread.

    Why: on loopback or a LAN, a send() costs the sender the receiver's side of TCP too,
    and the wake-up of the process waiting on the socket; releasing thousands of waiters is
    nothing but those sends, one CPU's worth, while the other CPUs idle. send() releases
    the GIL, so k threads send k slices at once. The loop thread does the first slice
    itself and waits for the others, so the turn goes on only when every slice is done, and
    the results come back in socket order.
    """

    def __init__(self, helpers: int):
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.results: "queue.SimpleQueue" = queue.SimpleQueue()
        self.helpers = [threading.Thread(target=self._work, name=f"distlib-store-io-{i}", daemon=True)
                        for i in range(helpers)]
        for t in self.helpers:
            t.start()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            index, fn, socks, arg = job
            self.results.put((index, fn(socks, arg)))

    def map_parts(self, fn, socks: List[socket.socket], args: list) -> list:
        """``fn(slice of socks, the same slice of args)`` over len(helpers)+1 slices at
        once; the slices' lists, joined in order."""
        parts = len(self.helpers) + 1
        step = -(-len(socks) // parts)
        for k in range(1, parts):
            self.jobs.put((k, fn, socks[k * step : (k + 1) * step], args[k * step : (k + 1) * step]))
        out = [fn(socks[:step], args[:step])] + [[]] * (parts - 1)
        for _ in range(1, parts):
            k, part = self.results.get()
            out[k] = part
        return [x for part in out for x in part]

    def close(self) -> None:
        for _ in self.helpers:
            self.jobs.put(None)


def _recv_part(socks: Sequence[socket.socket], size: int) -> list:
    """recv(size) on each socket in one C-level loop: per socket, the bytes; at the first
    failure, the exception, and None for the sockets after it (not read)."""
    results: list = []
    try:
        results.extend(map(_recv, socks, repeat(size)))
    except OSError as exc:  # results holds what the sockets before this one returned
        results.append(exc)
        results.extend(repeat(None, len(socks) - len(results)))
    return results


def _send_part(socks: Sequence[socket.socket], replies: Sequence[bytes]) -> List[int]:
    """send() each reply in one C-level loop: the bytes each took (0 from the first error on)."""
    sent: List[int] = []
    try:
        sent.extend(map(_send, socks, replies))
    except OSError:  # sent holds the counts of the sends before the failing one
        sent.extend(repeat(0, len(socks) - len(sent)))
    return sent


def send_replies(server: "StoreServer", conns: Sequence["Connection"], replies: List[bytes]) -> None:
    """Send ``replies[i]`` to ``conns[i]`` (each connection once, nothing pending), all
    with C-level loops (several threads for a large fan-out). Any reply a send() did not
    take whole (a full socket buffer, an error) goes back to that connection's ``out`` and
    onto ``server._dirty``, for ``_flush``'s general path."""
    socks = list(map(_sock_of, conns))
    pool = server.batch.pool if server.batch is not None and len(socks) >= PARALLEL_MIN else None
    if pool is not None:
        sent = pool.map_parts(_send_part, socks, replies)
    else:
        sent = _send_part(socks, replies)
    if sent == list(map(len, replies)):
        return
    dirty = server._dirty
    for conn, reply, taken in zip(conns, replies, sent):
        if taken < len(reply) and not conn.closed:
            conn.out.append(reply[taken:])
            dirty.append(conn)
