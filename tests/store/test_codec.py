"""codec.py: the one table of request layouts (encoders, decoders, sizes), checked against
the bytes torch 2.13 sends (docs/wire-protocol.md) and against every user of the table."""

from __future__ import annotations

import struct

import pytest

from distlib.store.tcp import codec
from distlib.store.tcp.codec import REQUESTS, Limits, Op, ProtocolError
from distlib.store.tcp.handlers import Handlers
from distlib.store.tcp.state import KeyValueState

LIMITS = Limits()


def u64(n):
    return struct.pack("<Q", n)


#: One request of every opcode, as (fields for codec.encode, the bytes torch 2.13 sends).
EXAMPLES = {
    Op.VALIDATE: ((codec.MAGIC,), b"\x00\xce\xf7\x85\x3c"),
    Op.SET: ((b"/k1", b"v1"), b"\x01" + u64(3) + b"/k1" + u64(2) + b"v1"),
    Op.COMPARE_SET: ((b"/cs", b"", b"first"), b"\x02" + u64(3) + b"/cs" + u64(0) + u64(5) + b"first"),
    Op.GET: ((b"/k1",), b"\x03" + u64(3) + b"/k1"),
    Op.ADD: ((b"init/", 1), b"\x04" + u64(5) + b"init/" + struct.pack("<q", 1)),
    Op.CHECK: (([b"/k1", b"/nokey"],), b"\x05" + u64(2) + u64(3) + b"/k1" + u64(6) + b"/nokey"),
    Op.WAIT: (([b"/k1"],), b"\x06" + u64(1) + u64(3) + b"/k1"),
    Op.GETNUMKEYS: ((), b"\x07"),
    Op.DELETE_KEY: ((b"/k1",), b"\x08" + u64(3) + b"/k1"),
    Op.APPEND: ((b"/ap", b"po"), b"\x09" + u64(3) + b"/ap" + u64(2) + b"po"),
    Op.MULTI_GET: (([b"/ma", b"/mb"],), b"\x0a" + u64(2) + u64(3) + b"/ma" + u64(3) + b"/mb"),
    Op.MULTI_SET: (([b"/ma", b"/mb"], [b"1", b"22"]),
                   b"\x0b" + u64(2) + u64(3) + b"/ma" + u64(1) + b"1" + u64(3) + b"/mb" + u64(2) + b"22"),
    Op.CANCEL_WAIT: ((), b"\x0c"),
    Op.PING: ((0x6341,), b"\x0d\x41\x63\x00\x00"),
    Op.QUEUE_PUSH: ((b"/q", b"y"), b"\x0e" + u64(2) + b"/q" + u64(1) + b"y"),
    Op.QUEUE_POP: ((b"/q",), b"\x0f" + u64(2) + b"/q"),
    Op.QUEUE_LEN: ((b"/q",), b"\x10" + u64(2) + b"/q"),
    Op.LIST_KEYS: ((), b"\x11"),
    Op.BARRIER: ((b"/bar", 2), b"\x12" + u64(4) + b"/bar" + struct.pack("<q", 2)),
}


def test_the_table_has_every_opcode_of_torch_2_13():
    assert set(REQUESTS) == set(Op) == set(EXAMPLES)


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.name)
def test_each_layout_encodes_torchs_bytes_and_decodes_them_back(op):
    fields, wire = EXAMPLES[op]
    assert codec.encode(op, *fields) == wire
    decoded_op, decoded, end = codec.decode(wire + b"\x07", 0, len(wire) + 1, LIMITS)
    assert (decoded_op, end) == (op, len(wire))
    if op == Op.MULTI_SET:
        assert decoded == (list(zip(*fields)),)
    else:
        assert decoded == fields


@pytest.mark.parametrize("op", list(Op), ids=lambda op: op.name)
def test_a_request_cut_anywhere_asks_for_more_and_never_for_less_than_it_has(op):
    """Every prefix of a request decodes to -need with need > the prefix: the server waits
    for that many bytes and then finds the request whole (no byte-by-byte re-parsing)."""
    wire = EXAMPLES[op][1]
    for cut in range(1, len(wire)):
        _, fields, r = codec.decode(wire[:cut], 0, cut, LIMITS)
        assert fields is None and cut < -r <= len(wire), (cut, r)
        assert codec.request_end(wire[:cut], 0, cut, LIMITS) == r


def test_requests_are_found_back_to_back_at_any_offset():
    stream = b"".join(wire for _, wire in EXAMPLES.values())
    pos, ops = 0, []
    while pos < len(stream):
        op, _, pos = codec.decode(stream, pos, len(stream), LIMITS)
        ops.append(op)
    assert ops == list(EXAMPLES)


@pytest.mark.parametrize("wire, message", [
    (b"\x01" + u64(8193), "key of 8193 bytes exceeds the limit of 8192 bytes"),
    (b"\x01" + u64(2) + b"/k" + u64(8 * 1024 * 1024 + 1), r"value of 8388609 bytes exceeds the limit of 8388608"),
    (b"\x02" + u64(1) + b"k" + u64(9 * 1024 * 1024), "expected value of"),
    (b"\x05" + u64(131073), "request lists 131073 keys, over the limit of 131072"),
    (b"\x0b" + u64(1) + u64(9000), "key of 9000 bytes"),
    (b"\x13", "unknown opcode 0x13"),
])
def test_a_length_over_the_limits_is_refused_as_soon_as_it_is_read(wire, message):
    """Only the length field has arrived: the request is refused before its bytes come."""
    with pytest.raises(ProtocolError, match=message):
        codec.decode(wire, 0, len(wire), LIMITS)


def test_the_named_encoders_are_the_tables():
    assert codec.validate() == EXAMPLES[Op.VALIDATE][1]
    assert codec.ping(0x6341) == EXAMPLES[Op.PING][1]
    assert codec.set_(b"/k1", b"v1") == EXAMPLES[Op.SET][1]
    assert codec.get(b"/k1") == EXAMPLES[Op.GET][1]
    assert codec.add(b"init/", 1) == EXAMPLES[Op.ADD][1]
    assert codec.compare_set(b"/cs", b"", b"first") == EXAMPLES[Op.COMPARE_SET][1]
    assert codec.multi_set([b"/ma", b"/mb"], [b"1", b"22"]) == EXAMPLES[Op.MULTI_SET][1]
    assert codec.barrier(b"/bar", 2) == EXAMPLES[Op.BARRIER][1]
    assert codec.keys_request(Op.WAIT, [b"/k1"]) == codec.OP_U64_U64.pack(Op.WAIT, 1, 3) + b"/k1"


def test_the_server_has_a_handler_for_every_opcode_and_only_those():
    table = Handlers(KeyValueState(lambda waiter: None), LIMITS, lambda conn, n: None).table()
    unknown = table[0xFF]
    assert {op for op in range(256) if table[op] != unknown} == set(REQUESTS)
