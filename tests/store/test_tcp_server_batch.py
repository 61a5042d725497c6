"""The server's batch path (distlib/store/tcp/batch.py) against the general path's behaviour.

Each test builds a server that is not serving, connects clients to it through socket pairs,
and hands ``turn`` a chosen list of events, so that the order of requests within one loop
turn is the test's, not the scheduler's.
"""

from __future__ import annotations

import select
import socket
import threading

import pytest

from distlib.store.tcp import StoreServer
from distlib.store.tcp import codec as proto
from distlib.store.tcp.batch import FRAME_CACHE_SIZE, MIN_EVENTS, PARALLEL_MIN, SLICE, FanOut, frame_kind
from distlib.store.tcp.connection import CONN_EVENTS, Connection

EPOLLIN = select.EPOLLIN
MAX_I64 = (1 << 63) - 1


class Turns:
    """A StoreServer with clients attached by hand; ``turn`` runs one loop turn."""

    def __init__(self, batch: bool = True, min_events: int = 1):
        self.server = StoreServer("127.0.0.1", 0, batch_path=batch)
        if batch:  # the tests' turns are small: let the batch path take them (unless a test says)
            self.server.batch.min_events = min_events
        self.ep = self.server.ep
        self.clients = []
        self.conns = []

    def client(self):
        mine, theirs = socket.socketpair()
        theirs.setblocking(False)
        conn = Connection(theirs, f"client-{len(self.clients)}")
        conn.validated = True
        self.server.conns[conn.fd] = conn
        self.ep.register(conn.fd, CONN_EVENTS)
        mine.settimeout(2)
        self.clients.append(mine)
        self.conns.append(conn)
        return mine, conn

    def turn(self, *clients, events=None):
        """One loop turn with an EPOLLIN event for each of ``clients``, in that order."""
        if events is None:
            events = [(self.conns[self.clients.index(c)].fd, EPOLLIN) for c in clients]
        self.server.turn(events)

    def close(self):
        for c in self.clients:
            c.close()
        self.server.close()  # (and the connections still open)


@pytest.fixture(params=[True, False], ids=["batch", "general"])
def turns(request):
    t = Turns(batch=request.param)
    yield t
    t.close()


@pytest.fixture
def batched():
    t = Turns(batch=True)
    yield t
    t.close()


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


def nothing_to_read(sock) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(2)
    return False


def i64(data: bytes) -> int:
    return proto.I64.unpack(data)[0]


def wait(key: bytes) -> bytes:
    return proto.keys_request(proto.Op.WAIT, [key])


def test_adds_in_one_turn_get_the_values_of_their_order(turns):
    a, b, c = (turns.client()[0] for _ in range(3))
    a.sendall(proto.add(b"k", 1))
    b.sendall(proto.add(b"k", 1))
    c.sendall(proto.add(b"k", 5))
    turns.turn(c, a, b)
    assert [i64(recv_exact(s, 8)) for s in (c, a, b)] == [5, 6, 7]
    assert turns.server.state.data[b"k"] == b"7"


def test_adds_on_several_keys_and_waits_between_them_see_every_add_before_them(turns):
    """The batch path keeps a run of ADDs on one key as a running sum and stores it when the
    run ends: a WAIT, an ADD on another key, a waiter and the general path must still see
    each ADD before them."""
    server = turns.server
    server.state.data[b"near-max"] = b"%d" % (MAX_I64 - 1)
    old_waiter = turns.client()[0]
    old_waiter.sendall(wait(b"k1"))
    turns.turn(old_waiter)
    c = [turns.client()[0] for _ in range(11)]
    c[0].sendall(proto.add(b"k1", 1))
    c[1].sendall(proto.add(b"k1", 1))
    c[2].sendall(wait(b"k2"))  # absent: waits
    c[3].sendall(proto.add(b"k2", 3))  # creates k2: releases c[2]
    c[4].sendall(proto.add(b"k1", 1))
    c[5].sendall(wait(b"k1"))  # present (the run before c[2] was stored): answered at once
    c[6].sendall(proto.add(b"k1", 1))
    c[7].sendall(proto.add(b"near-max", 1))
    c[8].sendall(proto.add(b"near-max", 1))  # wraps in the middle of a run
    c[9].sendall(proto.add(b"k3", 5))  # a new key...
    c[10].sendall(wait(b"k3"))  # ...that a WAIT right behind it is released by
    turns.turn(*c)
    assert recv_exact(old_waiter, 1) == bytes([proto.STOP_WAITING])
    assert [i64(recv_exact(c[i], 8)) for i in (0, 1, 3, 4, 6, 7, 8)] == [1, 2, 3, 3, 4, MAX_I64, -(1 << 63)]
    assert i64(recv_exact(c[9], 8)) == 5
    assert recv_exact(c[2], 1) == recv_exact(c[5], 1) == recv_exact(c[10], 1) == bytes([proto.STOP_WAITING])
    assert (server.state.data[b"k1"], server.state.data[b"k2"], server.state.data[b"near-max"]) == (b"4", b"3", b"%d" % -(1 << 63))
    assert not server.state.waiters


def test_the_batch_path_takes_plain_add_and_wait_turns(batched):
    a, b = (batched.client()[0] for _ in range(2))
    a.sendall(proto.add(b"k", 2))
    b.sendall(wait(b"k2"))
    batched.turn(a, b)
    assert i64(recv_exact(a, 8)) == 2
    assert set(batched.server.batch.frames) == {proto.add(b"k", 2), wait(b"k2")}
    assert batched.conns[1].wait_count == 1 and batched.server.state.waiters[b"k2"] == [batched.conns[1]]


def test_small_turns_go_through_the_general_path():
    """A turn of fewer than MIN_EVENTS events (a single client's request) skips the batch
    path: its setup would cost such a turn more than it saves."""
    t = Turns(batch=True, min_events=MIN_EVENTS)
    try:
        clients = [t.client()[0] for _ in range(MIN_EVENTS)]
        for s in clients[:-1]:
            s.sendall(proto.add(b"k", 1))
        t.turn(*clients[:-1])
        assert t.server.batch.frames == {}  # the batch path never looked at a frame
        assert [i64(recv_exact(s, 8)) for s in clients[:-1]] == list(range(1, MIN_EVENTS))
        for s in clients:
            s.sendall(proto.add(b"k", 1))
        t.turn(*clients)  # MIN_EVENTS events: the batch path's
        assert proto.add(b"k", 1) in t.server.batch.frames
        assert [i64(recv_exact(s, 8)) for s in clients] == list(range(MIN_EVENTS, 2 * MIN_EVENTS))
    finally:
        t.close()


def test_a_request_the_batch_path_does_not_run_keeps_its_place(turns):
    """ADD, GET, ADD on one key in one turn: the GET sees the first ADD only."""
    a, b, c = (turns.client()[0] for _ in range(3))
    a.sendall(proto.add(b"k", 1))
    b.sendall(proto.get(b"k"))
    c.sendall(proto.add(b"k", 1))
    turns.turn(a, b, c)
    assert i64(recv_exact(a, 8)) == 1
    assert recv_exact(b, 9) == proto.U64.pack(1) + b"1"
    assert i64(recv_exact(c, 8)) == 2


def test_waiters_are_released_together_and_can_go_on(turns):
    waiters = [turns.client()[0] for _ in range(5)]
    setter = turns.client()[0]
    for w in waiters:
        w.sendall(wait(b"done"))
    turns.turn(*waiters)
    assert all(nothing_to_read(w) for w in waiters)
    setter.sendall(proto.set_(b"done", b"1"))
    turns.turn(setter)
    assert [recv_exact(w, 1) for w in waiters] == [bytes([proto.STOP_WAITING])] * 5
    assert b"done" not in turns.server.state.waiters
    assert all(c.wait_count == 0 and not c.wait_keys for c in turns.conns)
    waiters[0].sendall(proto.add(b"n", 3))  # a released connection runs its next request
    turns.turn(waiters[0])
    assert i64(recv_exact(waiters[0], 8)) == 3


def test_wait_on_a_present_key_answers_at_once(turns):
    a, b = (turns.client()[0] for _ in range(2))
    a.sendall(proto.add(b"k", 1))
    b.sendall(wait(b"k"))
    turns.turn(a, b)
    assert i64(recv_exact(a, 8)) == 1
    assert recv_exact(b, 1) == bytes([proto.STOP_WAITING])


def test_an_add_creates_the_key_a_waiter_of_the_same_turn_waits_for(turns):
    a, b = (turns.client()[0] for _ in range(2))
    a.sendall(wait(b"k"))
    b.sendall(proto.add(b"k", 1))
    turns.turn(a, b)
    assert recv_exact(a, 1) == bytes([proto.STOP_WAITING])
    assert i64(recv_exact(b, 8)) == 1


def test_a_multi_key_waiter_is_released_only_by_its_last_key(turns):
    multi, single = (turns.client()[0] for _ in range(2))
    setter = turns.client()[0]
    multi.sendall(proto.keys_request(proto.Op.WAIT, [b"x", b"y"]))
    single.sendall(wait(b"x"))
    turns.turn(multi, single)
    setter.sendall(proto.set_(b"x", b"1"))
    turns.turn(setter)
    assert recv_exact(single, 1) == bytes([proto.STOP_WAITING])
    assert nothing_to_read(multi)
    setter.sendall(proto.set_(b"y", b"1"))
    turns.turn(setter)
    assert recv_exact(multi, 1) == bytes([proto.STOP_WAITING])


def test_add_wraps_at_int64_as_the_general_path_does(turns):
    turns.server.state.data[b"k"] = b"%d" % MAX_I64
    a = turns.client()[0]
    a.sendall(proto.add(b"k", 1))
    turns.turn(a)
    assert i64(recv_exact(a, 8)) == -(1 << 63)
    assert turns.server.state.data[b"k"] == b"%d" % -(1 << 63)


def test_add_that_overflows_a_short_counter_wraps(turns):
    turns.server.state.data[b"k"] = b"5"
    a = turns.client()[0]
    a.sendall(proto.add(b"k", MAX_I64))
    turns.turn(a)
    assert i64(recv_exact(a, 8)) == -(1 << 63) + 4


def test_a_request_behind_a_pending_wait_waits_for_it(turns):
    """ADD from a connection whose WAIT is pending runs after the wait, even when the
    turn's other requests are ADDs on the same key."""
    waiter, other, setter = (turns.client()[0] for _ in range(3))
    waiter.sendall(wait(b"go"))
    turns.turn(waiter)
    waiter.sendall(proto.add(b"n", 1))
    other.sendall(proto.add(b"n", 1))
    turns.turn(waiter, other)
    assert i64(recv_exact(other, 8)) == 1
    assert nothing_to_read(waiter)
    setter.sendall(proto.set_(b"go", b"1"))
    turns.turn(setter)
    assert recv_exact(waiter, 9) == bytes([proto.STOP_WAITING]) + proto.I64.pack(2)


def test_add_on_a_value_that_is_not_a_number_closes_only_that_client(turns):
    turns.server.state.data[b"text"] = b"hello"
    bad, good = (turns.client()[0] for _ in range(2))
    bad.sendall(proto.add(b"text", 1))
    good.sendall(proto.add(b"k", 1))
    turns.turn(bad, good)
    assert bad.recv(8) == b""  # closed
    assert i64(recv_exact(good, 8)) == 1
    assert turns.server.state.data[b"text"] == b"hello"


def test_counters_that_are_not_plain_digits_are_read_with_strtoll_rules(turns):
    turns.server.state.data[b"k"] = b"-5"
    turns.server.state.data[b"j"] = b" 7xyz"
    a, b = (turns.client()[0] for _ in range(2))
    a.sendall(proto.add(b"k", 2))
    b.sendall(proto.add(b"j", 1))
    turns.turn(a, b)
    assert i64(recv_exact(a, 8)) == -3
    assert i64(recv_exact(b, 8)) == 8


def test_a_partial_frame_waits_for_its_rest(turns):
    a, b = (turns.client()[0] for _ in range(2))
    frame = proto.add(b"key", 4)
    a.sendall(frame[:10])
    b.sendall(proto.add(b"key", 1))
    turns.turn(a, b)
    assert i64(recv_exact(b, 8)) == 1
    assert nothing_to_read(a)
    a.sendall(frame[10:])
    turns.turn(a)
    assert i64(recv_exact(a, 8)) == 5


def test_pipelined_requests_in_one_read_all_run(turns):
    a = turns.client()[0]
    a.sendall(proto.add(b"k", 1) + proto.add(b"k", 1) + wait(b"k"))
    turns.turn(a)
    assert recv_exact(a, 17) == proto.I64.pack(1) + proto.I64.pack(2) + bytes([proto.STOP_WAITING])


def test_a_spurious_event_in_the_middle_of_a_turn(turns):
    """No data behind one event (recv raises BlockingIOError): the others still run, in
    order, and that connection stays open."""
    a, b, c = (turns.client()[0] for _ in range(3))
    a.sendall(proto.add(b"k", 1))
    c.sendall(proto.add(b"k", 1))
    turns.turn(a, b, c)
    assert i64(recv_exact(a, 8)) == 1 and i64(recv_exact(c, 8)) == 2
    assert not turns.conns[1].closed
    b.sendall(proto.add(b"k", 1))
    turns.turn(b)
    assert i64(recv_exact(b, 8)) == 3


def test_a_client_gone_in_the_middle_of_a_turn_is_closed_and_forgotten(turns):
    a, b, c = (turns.client()[0] for _ in range(3))
    a.sendall(proto.add(b"k", 1))
    b.close()
    c.sendall(wait(b"d"))
    turns.turn(a, b, c)
    assert i64(recv_exact(a, 8)) == 1
    assert turns.conns[1].closed and turns.conns[1].fd not in turns.server.conns
    assert turns.server.state.waiters[b"d"] == [turns.conns[2]]


def test_a_reset_connection_in_the_middle_of_a_turn_is_closed_with_a_log_line(turns, caplog):
    a, b, c = (turns.client()[0] for _ in range(3))
    turns.conns[1].sock.send(b"unread")  # a UNIX socket closed with unread data resets its peer
    b.close()
    a.sendall(proto.add(b"k", 1))
    c.sendall(proto.add(b"k", 1))
    with caplog.at_level("WARNING", "distlib.store.tcp.server"):
        turns.turn(a, b, c)
    assert i64(recv_exact(a, 8)) == 1 and i64(recv_exact(c, 8)) == 2
    assert turns.conns[1].closed
    assert any("receive failed" in r.getMessage() for r in caplog.records)


def test_a_reply_the_socket_cannot_take_is_sent_when_it_drains(turns):
    a, conn = turns.client()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    filler = b"x" * 4096
    while True:  # fill the path to the client as if it had stopped reading
        try:
            conn.sock.send(filler)
        except BlockingIOError:
            break
    a.sendall(proto.add(b"k", 7))
    turns.turn(a)
    assert conn.pending is not None and not conn.closed  # kept, to go out later
    a.setblocking(False)
    drained = b""
    while True:
        try:
            chunk = a.recv(1 << 16)
        except BlockingIOError:
            break
        drained += chunk
    assert set(drained) == {ord("x")}
    turns.turn(events=[(conn.fd, select.EPOLLOUT)])
    a.settimeout(2)
    assert i64(recv_exact(a, 8)) == 7


def test_the_worker_counter_goes_through_the_general_path(batched):
    a = batched.client()[0]
    a.sendall(proto.add(proto.WORKER_COUNTER_KEY, 1))
    batched.turn(a)
    assert i64(recv_exact(a, 8)) == 1
    assert batched.server.workers_joined == 1
    assert proto.add(proto.WORKER_COUNTER_KEY, 1) not in batched.server.batch.frames


def test_a_turn_of_many_clients_is_shared_by_threads_and_keeps_its_order(turns, monkeypatch):
    """PARALLEL_MIN + 50 clients in one turn (recv()s and send()s split across threads when
    there are threads): ADD values follow the turn's order, a GET in the middle sees the
    ADDs before it, and a release reaches every waiter."""
    n = PARALLEL_MIN + 50
    clients = [turns.client()[0] for _ in range(n)]
    order = clients[::-1]
    for i, c in enumerate(order):
        c.sendall(proto.get(b"k") if i == 100 else proto.add(b"k", 1))
    turns.turn(*order)
    values = []
    for i, c in enumerate(order):
        if i == 100:
            assert recv_exact(c, 8 + 3) == proto.U64.pack(3) + b"100"
        else:
            values.append(i64(recv_exact(c, 8)))
    assert values == list(range(1, n))
    for c in clients:
        c.sendall(wait(b"go"))
    turns.turn(*clients)
    setter = turns.client()[0]
    setter.sendall(proto.set_(b"go", b"1"))
    turns.turn(setter)
    assert [recv_exact(c, 1) for c in clients] == [bytes([proto.STOP_WAITING])] * n


def test_fan_out_joins_the_slices_in_order():
    pool = FanOut(2)
    try:
        for n in (10, SLICE * 7 + 3):
            items = list(range(n))
            assert pool.map_parts(lambda part, arg: [x * y for x, y in zip(part, arg, strict=True)], items, [3] * n) == [x * 3 for x in items]
            assert pool.map_parts(lambda part, arg: [a + b for a, b in zip(part, arg, strict=True)], items, items) == [2 * x for x in items]
    finally:
        pool.close()


class _Stuck:
    """A job that keeps a FanOut helper busy until ``gate`` is set."""

    def __init__(self):
        self.gate = threading.Event()
        self.started = threading.Event()

    def run(self):
        self.started.set()
        self.gate.wait(30)


def test_fan_out_does_not_wait_for_a_helper_that_cannot_run():
    """A helper that does not get a CPU (the clients have them) must not hold the loop
    thread: it sends every slice itself."""
    pool = FanOut(1)
    stuck = _Stuck()
    pool.jobs.put(stuck)
    assert stuck.started.wait(5)
    result = []
    items = list(range(SLICE * 4))
    loop = threading.Thread(target=lambda: result.append(
        pool.map_parts(lambda part, arg: [x + 1 for x in part], items, items)), daemon=True)
    try:
        loop.start()
        loop.join(5)
        assert not loop.is_alive(), "map_parts waited for a helper that could not run"
        assert result == [[x + 1 for x in items]]
    finally:
        stuck.gate.set()
        pool.close()


def test_fan_out_raises_what_a_slice_raised():
    pool = FanOut(1)

    def send(part, arg):
        if SLICE in part:
            raise ValueError("slice 2 failed")
        return part

    try:
        with pytest.raises(ValueError, match="slice 2 failed"):
            pool.map_parts(send, list(range(SLICE * 3)), [0] * (SLICE * 3))
    finally:
        pool.close()


def test_frame_kind_knows_exactly_one_complete_add_or_single_key_wait():
    limits = proto.Limits()
    assert frame_kind(proto.add(b"k", -3), limits) == (proto.Op.ADD, b"k", -3)
    assert frame_kind(wait(b"k"), limits) == (proto.Op.WAIT, b"k", 0)
    assert frame_kind(proto.add(b"k", 1)[:-1], limits) is None  # truncated
    assert frame_kind(proto.add(b"k", 1) * 2, limits) is None  # two requests
    assert frame_kind(proto.keys_request(proto.Op.WAIT, [b"a", b"b"]), limits) is None
    assert frame_kind(proto.set_(b"k", b"v" * 20), limits) is None
    assert frame_kind(proto.add(proto.WORKER_COUNTER_KEY, 1), limits) is None  # the master counts workers
    assert frame_kind(proto.add(b"k" * 20, 1), proto.Limits(max_key=10)) is None  # over the key limit


def test_the_frame_cache_is_bounded(batched):
    path = batched.server.batch
    for i in range(FRAME_CACHE_SIZE + 10):
        path.kind(proto.add(b"key-%d" % i, 1))
    assert 0 < len(path.frames) <= FRAME_CACHE_SIZE


def test_batch_path_off_by_argument():
    server = StoreServer("127.0.0.1", 0, batch_path=False)
    try:
        assert server.batch is None and server.sender.batch is None
    finally:
        server.close()


def test_waits_on_several_keys_in_one_turn_are_each_released_by_their_key(turns):
    """Runs of WAITs on one key (the batch path registers each run at once), interleaved with
    other keys and ADDs: each waiter is released by its own key only, and nothing stays charged."""
    clients = [turns.client()[0] for _ in range(7)]
    keys = [b"x", b"x", b"y", b"x", b"y", b"y"]
    for c, k in zip(clients, keys, strict=False):
        c.sendall(wait(k))
    clients[6].sendall(proto.add(b"z", 1))
    turns.turn(*clients)
    assert i64(recv_exact(clients[6], 8)) == 1
    assert all(nothing_to_read(c) for c in clients[:6])
    assert turns.server.state.wait_bytes == 6 * (1 + 56) + 2 * 128
    setter = turns.client()[0]
    setter.sendall(proto.set_(b"y", b"1"))
    turns.turn(setter)
    for c, k in zip(clients, keys, strict=False):
        assert (recv_exact(c, 1) == bytes([proto.STOP_WAITING])) if k == b"y" else nothing_to_read(c)
    setter.sendall(proto.set_(b"x", b"1"))
    turns.turn(setter)
    assert all(recv_exact(c, 1) == bytes([proto.STOP_WAITING]) for c, k in zip(clients, keys, strict=False) if k == b"x")
    assert turns.server.state.wait_bytes == 0


def test_a_wait_over_the_cap_of_keys_waited_for_is_refused_not_fatal(turns):
    """A turn's WAIT on a new key when the state already waits for its most: the general
    path closes that client; the others of the turn are served."""
    turns.server.state.max_waiting_keys = 1
    first, second, third = (turns.client()[0] for _ in range(3))
    first.sendall(wait(b"a"))
    turns.turn(first)
    second.sendall(wait(b"b"))
    third.sendall(wait(b"a"))
    turns.turn(second, third)
    second.settimeout(2)
    assert second.recv(1) == b""  # closed
    assert nothing_to_read(third)  # waits with the first
    assert len(turns.server.state.waiters[b"a"]) == 2
