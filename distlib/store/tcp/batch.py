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
* ADD does what ``StoreServer._add_to`` does (int64 wrap-around, the value stored as
  decimal and waiters woken through ``StoreServer._store_counter``), for a run of ADDs on
  one key as a running sum stored once, before anything else in the turn looks at it;
  counters that are not plain decimal go to the general path, which owns the parse errors. WAIT answers at once or registers through ``StoreServer._wait_for``, as
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
from collections import deque
from itertools import count, repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from ...cpus import usable_cpus
from ..base import INT64_MAX, INT64_MIN, wrap_int64
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
        store_counter = server._store_counter
        queues = server.queues
        known = self.frames.get
        dirty = server._dirty
        done = 0
        # ADDs on one key (a barrier's arrivals, WAITs between them): a running sum, stored
        # once, when an ADD on another key or the batch ends; each ADD's reply is the sum
        # after it, as if each were stored.
        counter_key = None
        total = 0
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
                if key != counter_key:
                    if counter_key is not None:
                        store_counter(counter_key, total)
                        counter_key = None
                    old = data.get(key)
                    if old is None:
                        total = 0
                    elif old.isdigit() and len(old) < 19:
                        total = int(old)
                    else:
                        break  # not a plain decimal counter: _op_add parses (and rejects) it
                    counter_key = key
                total += delta
                if total > INT64_MAX or total < INT64_MIN:
                    total = wrap_int64(total)
                conn.out.append(_pack_i64(total))
                dirty.append(conn)
            elif key in data or queues.get(key):
                conn.out.append(_STOP)
                dirty.append(conn)
            else:  # (on a counter not stored yet: the store at the end of the run wakes it)
                wait_for(conn, [key])
            done += 1
        if counter_key is not None:
            store_counter(counter_key, total)

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
#: Sockets per slice of a fan-out: the unit of work a thread claims.
SLICE = 128


class FanOut:
    """Helper threads that share a large fan-out's send()s with the loop thread.

    Why: on loopback or a LAN, a send() costs the sender the receiver's side of TCP too,
    and the wake-up of the process waiting on the socket; releasing thousands of waiters is
    nothing but those sends, one CPU's worth, while the other CPUs idle. send() releases
    the GIL, so k threads send k slices at once.

    The loop thread does not wait for a helper to start: every thread, the loop's included,
    claims slices until none is left, and the loop thread waits only for slices a helper
    has claimed and not finished. When the other CPUs are busy (the clients are running, as
    while a barrier's ranks arrive), a helper may not run for a scheduler tick; the loop
    thread then sends every slice itself instead of sitting idle behind it. Results come
    back in socket order.
    """

    def __init__(self, helpers: int):
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.helpers = [threading.Thread(target=self._work, name=f"distlib-store-io-{i}", daemon=True)
                        for i in range(helpers)]
        for t in self.helpers:
            t.start()

    def _work(self) -> None:
        while True:
            task = self.jobs.get()
            if task is None:
                return
            task.run()

    def map_parts(self, fn, socks: List[socket.socket], args: list) -> list:
        """``fn(slice of socks, the same slice of args)`` over slices of SLICE sockets, run
        by whichever threads get to them; the slices' lists, joined in order."""
        task = _Slices(fn, [(socks[k : k + SLICE], args[k : k + SLICE]) for k in range(0, len(socks), SLICE)])
        for _ in self.helpers:
            self.jobs.put(task)
        task.run()
        task.done.wait()
        if task.error is not None:
            raise task.error
        return [x for part in task.results for x in part]

    def close(self) -> None:
        for _ in self.helpers:
            self.jobs.put(None)


class _Slices:
    """One fan-out: its slices, claimed one at a time by any thread (``deque.popleft`` and
    ``next`` on a counter are atomic under the GIL); ``done`` is set by whoever finishes
    the last one, or by a slice that raised."""

    __slots__ = ("fn", "pending", "results", "finished", "done", "error")

    def __init__(self, fn, slices: list):
        self.fn = fn
        self.pending = deque(enumerate(slices))
        self.results: list = [()] * len(slices)
        self.finished = count(1)
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        claim, fn, results = self.pending.popleft, self.fn, self.results
        last = len(results)
        while True:
            try:
                index, (socks, args) = claim()
            except IndexError:
                return
            try:
                results[index] = fn(socks, args)
            except BaseException as exc:  # noqa: BLE001 - map_parts re-raises it in the loop thread
                self.error = exc
                self.done.set()
                return
            if next(self.finished) == last:
                self.done.set()


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
    pool = server.batch.pool if len(socks) >= PARALLEL_MIN else None
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
