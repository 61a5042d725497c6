"""Hypothesis: random sequences of changes, some numbered (a client session's sequenced writes),
run through the request engine of a server with a state directory, a compaction at a random
turn, then a crash that cuts the journal at a random byte. After replay the state equals a
model's after the turns that reached the disk whole, and re-sending the session's writes (as a
reconnecting client does) applies none twice and a lost one once."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from distlib.store.tcp import codec, sequence  # noqa: E402
from distlib.store.tcp.budget import MEMORY_BUDGET, ClientLimits  # noqa: E402
from distlib.store.tcp.codec import Limits  # noqa: E402
from distlib.store.tcp.connection import Connection  # noqa: E402
from distlib.store.tcp.engine import RequestEngine  # noqa: E402
from distlib.store.tcp.journal import Journal, journal_name  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SESSION = b"S" * 16
KEYS = [b"k0", b"k1", b"k2"]
COUNTERS = [b"c0", b"c1"]
QUEUES = [b"q0"]
VALUES = st.sampled_from([b"", b"a", b"bb", b"ccc"])

OPS = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), VALUES),
    st.tuples(st.just("add"), st.sampled_from(COUNTERS), st.integers(-5, 5)),
    st.tuples(st.just("append"), st.sampled_from(KEYS), VALUES),
    st.tuples(st.just("compare_set"), st.sampled_from(KEYS), st.tuples(VALUES, VALUES)),
    st.tuples(st.just("multi_set"), st.sampled_from(KEYS), VALUES),
    st.tuples(st.just("delete"), st.sampled_from(KEYS), st.none()),
    st.tuples(st.just("push"), st.sampled_from(QUEUES), VALUES),
    st.tuples(st.just("pop"), st.sampled_from(QUEUES), st.none()),
)
SEQUENCED = ("add", "append", "compare_set", "multi_set", "delete", "push", "pop")


class _Peer:
    def fileno(self) -> int:
        return -1


def request(op) -> bytes:
    kind, key, arg = op
    if kind == "set":
        return codec.set_(key, arg)
    if kind == "add":
        return codec.add(key, arg)
    if kind == "append":
        return codec.append(key, arg)
    if kind == "compare_set":
        return codec.compare_set(key, arg[0], arg[1])
    if kind == "multi_set":
        return codec.multi_set([key, b"m-" + key], [arg, arg + b"!"])
    if kind == "delete":
        return codec.delete_key(key)
    if kind == "push":
        return codec.queue_push(key, arg)
    return codec.queue_pop(key)


def model_apply(data: dict, queues: dict, op) -> None:
    """What the op does, written from torch's documentation (not from state.py)."""
    kind, key, arg = op
    if kind == "set":
        data[key] = arg
    elif kind == "add":
        data[key] = b"%d" % (int(data.get(key, b"0")) + arg)
    elif kind == "append":
        data[key] = data.get(key, b"") + arg
    elif kind == "compare_set":
        expected, desired = arg
        current = data.get(key)
        if (current is None and expected == b"") or (current is not None and current == expected):
            data[key] = desired
    elif kind == "multi_set":
        data[key], data[b"m-" + key] = arg, arg + b"!"
    elif kind == "delete":
        data.pop(key, None)
    elif kind == "push":
        queues.setdefault(key, []).append(arg)
    elif queues.get(key):
        queues[key].pop(0)
        if not queues[key]:
            del queues[key]


class Server:
    """An engine on a state directory, fed one request per loop turn (no sockets)."""

    def __init__(self, directory: str):
        self.journal = Journal(directory, "none")
        self.engine = RequestEngine(Limits(), ClientLimits(), MEMORY_BUDGET, lambda conn, value: None,
                                    journal=self.journal, image=self.journal.recover())
        self.conn = Connection(_Peer(), "fuzz")

    def turn(self, data: bytes) -> bytes:
        self.engine.feed(self.conn, data)
        self.journal.commit()  # (the loop commits before the replies go out)
        reply = b"".join(bytes(p) for p in self.conn.out)
        self.conn.out.clear()
        self.engine.answered.clear()
        return reply

    def state(self):
        return dict(self.engine.state.data), {k: list(q) for k, q in self.engine.state.queues.items()}

    def close(self) -> None:
        self.journal.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(OPS, st.booleans()), min_size=1, max_size=30), compact_at=st.integers(0, 40),
       cut=st.floats(0, 1))
def test_replay_after_a_crash_at_any_byte_equals_the_model(tmp_path_factory, ops, compact_at, cut):
    directory = str(tmp_path_factory.mktemp("state"))
    server = Server(directory)
    data, queues = {}, {}
    seq = 0
    turns = []  # per turn: (journal number, its size after the turn, model after, request, reply)
    for i, (op, numbered) in enumerate(ops):
        if i == compact_at:
            server.journal.compact()
            assert server.journal.wait_compaction(30)
        raw = request(op)
        if numbered and op[0] in SEQUENCED:
            seq += 1
            raw = sequence.sequence_header(SESSION, seq) + raw
        reply = server.turn(raw)
        model_apply(data, queues, op)
        turns.append((server.journal.number, server.journal.size, (dict(data), {k: list(v) for k, v in queues.items()}),
                      raw, reply))
        assert server.state() == turns[-1][2], f"turn {i} ({op}): the server's state differs from the model's"
    number = server.journal.number
    server.close()  # (every turn was written already: the crash is the cut below)
    path = os.path.join(directory, journal_name(number))
    size = os.path.getsize(path)
    offset = 8 + int(cut * (size - 8))
    os.truncate(path, offset)

    survived = [t for t in turns if t[0] < number or t[1] <= offset]
    restarted = Server(directory)
    try:
        expected = survived[-1][2] if survived else ({}, {})
        assert restarted.state() == expected, (f"after a crash at byte {offset} of {size}, {len(survived)} of "
                                               f"{len(turns)} turns survived; the replayed state differs")
        numbered_turns = [t for t in turns if t[3].startswith(sequence.SEQUENCE_PREFIX)]
        done = [t for t in numbered_turns if t in survived]
        if done:  # the last numbered write that reached the disk, re-sent: same reply, not applied again
            last = done[-1]
            assert restarted.turn(last[3]) == last[4], "a re-sent write got another reply than the first time"
            assert restarted.state() == expected, "a re-sent write that had reached the disk was applied again"
        lost = [t for t in turns[len(survived):]]
        if lost and lost[0][3].startswith(sequence.SEQUENCE_PREFIX):  # the write in flight, lost: applied once
            assert restarted.turn(lost[0][3]) == lost[0][4]
            assert restarted.state() == lost[0][2], "a re-sent write that the crash lost was not applied once"
    finally:
        restarted.close()
