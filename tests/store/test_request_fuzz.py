"""A bounded fuzz of the server's request path (hypothesis), run by `make test`.

The bytes go through the server's request engine (``RequestEngine``, engine.py: framing, the
many-key scanner, the held-request queue, backpressure, the handlers, the state), driven
through its public methods as the server's loop drives it, with no sockets. Inputs are
sequences of valid requests (the client's encoders) mixed with cut, spliced and random bytes,
under small limits so that every limit is hit.

What must hold, whatever the bytes:

* nothing but the closing errors the server handles (a malformed request, one the state
  refuses): any other exception is a crash of the event loop;
* the outcome does not depend on how the bytes were cut into reads (every reply, the
  stored keys, whether and why the connection was closed): the framing of a request that
  arrives in pieces is the framing of one that arrives whole;
* a valid request decodes to what was encoded, and ``ManyScan`` finds the end ``decode``
  finds, from any prefix on.

Each property runs a bounded number of examples (``EXAMPLES``, about 10 s in all on the
2-core reference machine); a failure prints the reproducing example.
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="the fuzz needs hypothesis (the test extras)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from distlib.store.tcp import codec as proto  # noqa: E402
from distlib.store.tcp.budget import MEMORY_BUDGET, ClientLimits  # noqa: E402
from distlib.store.tcp.codec import Limits, ManyScan, Op  # noqa: E402
from distlib.store.tcp.connection import Connection  # noqa: E402
from distlib.store.tcp.engine import RequestEngine  # noqa: E402
from distlib.store.tcp.handlers import CloseConnection  # noqa: E402

EXAMPLES = 1500
LIMITS = Limits(max_key=24, max_value=64, max_keys=6)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

keys = st.binary(max_size=28).map(lambda k: b"/" + k)  # sometimes over LIMITS.max_key
values = st.binary(max_size=72)  # sometimes over LIMITS.max_value
numbers = st.one_of(st.integers(-3, 3), st.integers(-(2 ** 63), 2 ** 63 - 1))
key_lists = st.lists(keys, max_size=8)  # sometimes over LIMITS.max_keys

valid_requests = st.one_of(
    st.builds(lambda k, v: proto.encode(Op.SET, k, v), keys, values),
    st.builds(lambda k, e, d: proto.encode(Op.COMPARE_SET, k, e, d), keys, values, values),
    st.builds(lambda k: proto.encode(Op.GET, k), keys),
    st.builds(lambda k, n: proto.encode(Op.ADD, k, n), keys, numbers),
    st.builds(lambda ks: proto.encode(Op.CHECK, ks), key_lists),
    st.builds(lambda ks: proto.encode(Op.WAIT, ks), key_lists),
    st.just(proto.encode(Op.GETNUMKEYS)),
    st.builds(lambda k: proto.encode(Op.DELETE_KEY, k), keys),
    st.builds(lambda k, v: proto.encode(Op.APPEND, k, v), keys, values),
    st.builds(lambda ks: proto.encode(Op.MULTI_GET, ks), key_lists),
    st.builds(lambda ks, vs: proto.encode(Op.MULTI_SET, ks, vs[: len(ks)] + [b""] * (len(ks) - len(vs))),
              key_lists, st.lists(values, max_size=8)),
    st.just(proto.encode(Op.CANCEL_WAIT)),
    st.builds(lambda n: proto.encode(Op.PING, n), st.integers(0, 2 ** 32 - 1)),
    st.builds(lambda k, v: proto.encode(Op.QUEUE_PUSH, k, v), keys, values),
    st.builds(lambda k: proto.encode(Op.QUEUE_POP, k), keys),
    st.builds(lambda k: proto.encode(Op.QUEUE_LEN, k), keys),
    st.just(proto.encode(Op.LIST_KEYS)),
    st.builds(lambda k, n: proto.encode(Op.BARRIER, k, n), keys, st.integers(-1, 4)),
)


@st.composite
def streams(draw):
    """Requests one connection sends: mostly valid, some cut short, spliced or random."""
    parts = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.integers(0, 9))
        request = draw(valid_requests)
        if kind == 0:
            parts.append(draw(st.binary(max_size=40)))  # noise
        elif kind == 1:
            parts.append(request[: draw(st.integers(0, len(request)))])  # cut short
        elif kind == 2 and len(request) > 1:  # a byte changed
            i = draw(st.integers(0, len(request) - 1))
            parts.append(request[:i] + bytes([draw(st.integers(0, 255))]) + request[i + 1:])
        else:
            parts.append(request)
    return b"".join(parts)


@st.composite
def cuts(draw, data: bytes):
    """``data`` cut into reads at random places."""
    points = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=10))))
    bounds = [0] + points + [len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


class _Peer:
    """What a Connection needs of its socket here: a descriptor number (the engine does no I/O)."""

    def fileno(self) -> int:
        return -1


def run(chunks):
    """Feed ``chunks`` to one connection as successive reads, as the server's loop does (its
    replies taken as sent, waits released, kept requests run); what came of it: (replies in
    order, stored data, queues, the reason the connection was closed or None)."""
    engine = RequestEngine(LIMITS, ClientLimits(), MEMORY_BUDGET, lambda conn, value: None)
    conn = Connection(_Peer(), "fuzz")
    replies = []
    reason = None

    def send():  # the end of a loop turn: the replies go out
        replies.extend(bytes(part) for part in conn.out)
        conn.out.clear()
        engine.answered.clear()

    try:
        for chunk in chunks:
            if not chunk:
                continue  # (an empty read is the end of the connection)
            go_on = engine.feed(conn, chunk)
            while True:
                while engine.released:
                    for released in engine.take_released():
                        engine.run_held(released)
                send()
                if go_on:
                    break
                assert conn.paused  # only backpressure stops reading
                conn.paused = False  # (what sending does once the replies are out)
                go_on = engine.run_kept(conn)
    except CloseConnection as exc:
        reason = str(exc)
        send()  # the replies of the requests before the bad one go out as it closes
    assert engine.budget.buffered == conn.buffered  # the budget's books balance
    return b"".join(replies), dict(engine.state.data), {k: list(v) for k, v in engine.state.queues.items()}, reason


@FUZZ
@given(st.data())
def test_any_bytes_in_any_cuts_give_what_they_give_whole(data):
    stream = data.draw(streams())
    whole = run([stream])
    assert run(data.draw(cuts(stream))) == whole


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_never_crash_the_request_path(stream):
    run([stream])
    run([stream[i:i + 7] for i in range(0, len(stream), 7)])


@FUZZ
@given(valid_requests, st.data())
def test_a_valid_request_decodes_to_its_fields_and_scans_to_its_end(request, data):
    big = Limits(max_key=1 << 20, max_value=1 << 20, max_keys=1 << 10)
    op, fields, end = proto.decode(request, 0, len(request), big)
    assert end == len(request)
    if op == Op.MULTI_SET:
        assert proto.encode(op, [k for k, _ in fields[0]], [v for _, v in fields[0]]) == request
    elif op in (Op.GETNUMKEYS, Op.CANCEL_WAIT, Op.LIST_KEYS):
        assert proto.encode(op) == request
    else:
        assert proto.encode(op, *fields) == request
    for cut in range(len(request)):  # every prefix: not complete, and the need goes past it
        op2, fields2, need = proto.decode(request[:cut] + b"", 0, cut, big) if cut else (None, None, -1)
        assert fields2 is None and -need > cut
    if op in proto.MANY_KEY_OPS:
        scan = ManyScan(op, big)
        for cut in sorted(set(data.draw(st.lists(st.integers(1, len(request) - 1), max_size=5)))):
            assert -scan.advance(request, cut) > cut
        assert scan.advance(request, len(request)) == len(request)
