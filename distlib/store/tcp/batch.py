"""The server's batch path: one loop turn's plain ADD and WAIT requests, run as C-level loops.

Why it exists: on a barrier of thousands of ranks (each ADDs one counter, then WAITs for one
key; torch's own store barrier has this shape), the server's time is nearly all kernel work
(recv, send, waking the clients) plus the interpreter's work per request. The general path
(a recv, a handler per request, a send per reply) runs about 150 bytecodes and 4 Python
calls per request. Here, the recv()s and send()s of a whole turn are ``map`` calls over the
sockets (no bytecode per socket), a request is recognised by looking its exact bytes up in a
dict of frames seen before, and what is left per request is a short loop body. A turn with
many replies to send (the release of thousands of waiters above all) is sent by
``send_replies``: C-level loops, split across threads (``FanOut``).

Contract with the server (what keeps the two paths one behaviour):

* The server offers a turn only if it has at least ``min_events`` events; ``take`` accepts
  it only when every event is a plain EPOLLIN on a connection in the plain state
  (``_PLAIN``: validated, nothing partial, nothing held, no wait, nothing pending, no unsent
  replies, not TLS). Otherwise the server's general loop takes the turn.
* ``run`` receives once from every connection and runs a received frame only if it is
  exactly one complete request of a kind ``frame_kind`` knows (ADD on any key but the worker
  counter, WAIT on one key). At the first one that is not, it stops, and the server runs
  that frame and every later one through the general path, in order, with the bytes already
  received: requests keep their arrival order.
* Requests run through the state's public methods only (state.py): the ADDs of a turn on
  one key are one ``add_many`` (one parse and one store; each reply is still the value
  after that ADD), stored when an ADD on another key comes or the run ends, before anything
  else in the turn looks at the key; a counter the state refuses (not a number) stops the
  batch there, so the general path reports it. The WAITs of a turn on one key are one
  ``state.wait_all`` (a barrier's ranks register with one list extension and one charge),
  run when a WAIT on another key comes or the run ends; a WAIT the state would refuse (over
  its cap of keys waited for) stops the batch there.
* Replies go where the general path puts them (each connection's ``out``, and the turn's
  ``dirty`` list); the server sends them at the end of the turn and hands a large turn's
  single replies to ``send_replies``, keeping partial sends, send errors and everything else
  to itself.

Connections are duck-typed (``sock``, ``out`` and the attributes of ``_PLAIN``): this
module imports neither the server nor anything that imports it.
"""

from __future__ import annotations

import queue
import select
import socket
import threading
from collections import deque
from itertools import count, repeat
from operator import attrgetter, itemgetter
from typing import Dict, List, Optional, Sequence, Tuple

from ...cpus import usable_cpus
from .codec import I64, STOP_WAITING, WORKER_COUNTER_KEY, Limits, Op, ProtocolError, read_key_i64, read_keys
from .state import KeyValueState, StateError

_ADD = int(Op.ADD)
_WAIT = int(Op.WAIT)
_pack_i64 = I64.pack
_STOP = bytes([STOP_WAITING])
_EPOLLIN = select.EPOLLIN

_fd_of = itemgetter(0)
_events_of = itemgetter(1)
_sock_of = attrgetter("sock")
_out_of = attrgetter("out")
_append = list.append
_recv = socket.socket.recv  # the C methods, so that map() calls them without bytecode
_send = socket.socket.send
#: A connection in this state has no partial request, nothing queued behind a wait, no
#: pending wait, no unsent output and no replies produced this turn.
_plain_state = attrgetter("validated", "inbuf", "held", "wait_count", "pending", "closed", "out", "tls")
_PLAIN: tuple = (True, None, None, 0, None, False, [], False)  # (TLS: its sockets are not socket.socket)

#: Turns of fewer events go through the general path. The batch path's own work per turn
#: (a few passes over the events, a frame lookup) pays off only over several requests.
MIN_EVENTS = 8
#: Threads (the loop's included) that share a large turn's socket calls, at most.
MAX_THREADS = 4
#: Frames remembered by ``frame_kind``; the cache starts over when it is full.
FRAME_CACHE_SIZE = 4096

Kind = Tuple[int, bytes, int]  # (opcode, key, ADD delta or 0)


def frame_kind(frame: bytes, limits: Limits) -> Optional[Kind]:
    """(opcode, key, delta) if ``frame`` is exactly one complete ADD (not on the worker
    counter) or one single-key WAIT within ``limits``; else None."""
    size = len(frame)
    if size < 17:
        return None
    op = frame[0]
    try:
        if op == _ADD:
            key, delta, end = read_key_i64(frame, 1, size, limits)
            if end != size or key == WORKER_COUNTER_KEY:  # the master counts its workers
                return None
            return _ADD, key, delta
        if op == _WAIT:
            keys, end = read_keys(frame, 1, size, limits)
            if end != size or len(keys) != 1:
                return None
            return _WAIT, keys[0], 0
    except ProtocolError:  # over a limit: the general path closes the connection
        return None
    return None


class BatchPath:
    """The batch path of one server's state (see the module docstring)."""

    def __init__(self, state: KeyValueState, limits: Limits):
        self.state = state
        self.limits = limits
        self.frames: Dict[bytes, Optional[Kind]] = {}
        #: The server offers a turn to ``take`` only if it has this many events.
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
        kind = frame_kind(frame, self.limits)
        if kind is not None:
            if len(self.frames) >= FRAME_CACHE_SIZE:
                self.frames.clear()
            self.frames[frame] = kind
        return kind

    def take(self, events: Sequence[Tuple[int, int]], conns: Dict[int, object]) -> Optional[list]:
        """The connections of the turn ``events`` (in order) if the batch path may run it,
        else None (a listener or the wake-up pipe, an event other than EPOLLIN, a
        connection not in the plain state)."""
        n = len(events)
        taken = list(map(conns.get, map(_fd_of, events)))
        if None in taken:
            return None
        if list(map(_events_of, events)).count(_EPOLLIN) != n:
            return None
        if list(map(_plain_state, taken)).count(_PLAIN) != n:
            return None
        return taken

    def run(self, conns: list, recv_size: int, dirty: list) -> Tuple[int, list]:
        """recv(recv_size) once on every connection, then run the leading frames it knows.

        Returns (how many connections' frames ran, what each recv returned: bytes, the
        exception of the first recv that failed, None for those after it). Connections
        with a reply are appended to ``dirty``. The server runs the rest.
        """
        # One thread: recv() is cheap beside send(), and splitting it measured no faster.
        results = _recv_part(list(map(_sock_of, conns)), recv_size)
        state = self.state
        known = self.frames.get
        done = 0
        # A run of ADDs on one key (a barrier's arrivals, WAITs between them): one add_many
        # when an ADD on another key comes or the batch ends.
        run_key = None
        run_deltas: List[int] = []
        run_conns: list = []
        wait_key = None  # likewise a run of WAITs on one key: one wait_all
        wait_conns: list = []
        for conn, frame in zip(conns, results, strict=True):
            kind = known(frame)
            if kind is None:
                if frame.__class__ is not bytes or len(frame) >= recv_size:
                    break  # more may be waiting: the general path reads on
                kind = self.kind(frame)
                if kind is None:
                    break
            op, key, delta = kind
            if op == _ADD:
                if key != run_key:
                    if run_key is not None:
                        _store_run(state, run_key, run_deltas, run_conns, dirty)
                        run_key = None
                    try:
                        state.counter(key)
                    except StateError:
                        break  # the general path reports it
                    run_key, run_deltas, run_conns = key, [], []
                run_deltas.append(delta)
                run_conns.append(conn)
            elif key == wait_key:
                wait_conns.append(conn)
            else:
                if wait_key is not None:
                    _wait_run(state, wait_key, wait_conns, dirty)
                    wait_key = None
                if not state.may_wait_for(key):
                    break  # the general path refuses it
                wait_key, wait_conns = key, [conn]
            done += 1
        if run_key is not None:
            _store_run(state, run_key, run_deltas, run_conns, dirty)
        if wait_key is not None:  # (after the ADDs: a WAIT on their counter finds it stored)
            _wait_run(state, wait_key, wait_conns, dirty)
        return done, results

    def send_replies(self, conns: list, replies: List[bytes]) -> list:
        """Send ``replies[i]`` to ``conns[i]`` (each connection once, nothing pending), all
        with C-level loops (several threads for a large fan-out). Returns the connections
        whose reply a send() did not take whole (a full socket buffer, an error), with the
        rest put back in their ``out``, for the server's general path."""
        socks = list(map(_sock_of, conns))
        pool = self.pool if len(socks) >= PARALLEL_MIN else None
        if pool is not None:
            sent = pool.map_parts(_send_part, socks, replies)
        else:
            sent = _send_part(socks, replies)
        if sent == list(map(len, replies)):
            return []
        rest = []
        for conn, reply, taken in zip(conns, replies, sent, strict=True):
            if taken < len(reply) and not conn.closed:
                conn.out.append(reply[taken:])
                rest.append(conn)
        return rest


def _store_run(state: KeyValueState, key: bytes, deltas: List[int], conns: list, dirty: list) -> None:
    """The ADDs of one run: one ``add_many``, each connection's reply its own value (a
    C-level loop: ``out.append(pack(value))`` for every connection of the run)."""
    list(map(_append, map(_out_of, conns), map(_pack_i64, state.add_many(key, deltas))))
    dirty += conns


def _wait_run(state: KeyValueState, key: bytes, conns: list, dirty: list) -> None:
    """The one-key WAITs of one run: one ``wait_all``; STOP_WAITING for each at once when the
    key is there."""
    if state.wait_all(conns, key):
        list(map(_append, map(_out_of, conns), repeat(_STOP, len(conns))))
        dirty += conns


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

