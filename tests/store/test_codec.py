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
        assert decoded == (list(zip(*fields, strict=True)),)
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


#: Each request a client sends, by its encoder's name in codec.py: (opcode, fields).
NAMED = {
    "validate": (Op.VALIDATE, ()), "ping": (Op.PING, (0x6341,)), "set_": (Op.SET, (b"/k1", b"v1")),
    "compare_set": (Op.COMPARE_SET, (b"/cs", b"", b"first")), "get": (Op.GET, (b"/k1",)),
    "add": (Op.ADD, (b"init/", 1)), "check": (Op.CHECK, ([b"/k1", b"/nokey"],)), "wait": (Op.WAIT, ([b"/k1"],)),
    "getnumkeys": (Op.GETNUMKEYS, ()), "delete_key": (Op.DELETE_KEY, (b"/k1",)), "append": (Op.APPEND, (b"/ap", b"po")),
    "multi_get": (Op.MULTI_GET, ([b"/ma", b"/mb"],)), "multi_set": (Op.MULTI_SET, ([b"/ma", b"/mb"], [b"1", b"22"])),
    "cancel_wait": (Op.CANCEL_WAIT, ()), "queue_push": (Op.QUEUE_PUSH, (b"/q", b"y")),
    "queue_pop": (Op.QUEUE_POP, (b"/q",)), "queue_len": (Op.QUEUE_LEN, (b"/q",)), "list_keys": (Op.LIST_KEYS, ()),
    "barrier": (Op.BARRIER, (b"/bar", 2)),
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_each_named_encoder_sends_torchs_bytes(name):
    op, fields = NAMED[name]
    assert getattr(codec, name)(*fields) == EXAMPLES[op][1], f"codec.{name} differs from torch's {op.name} bytes"


def test_every_opcode_a_client_sends_has_a_named_encoder():
    assert {op for op, _ in NAMED.values()} == set(REQUESTS)


def test_one_key_wait_and_the_pipelined_get():
    assert codec.wait((b"/k1",)) == codec.OP_U64_U64.pack(Op.WAIT, 1, 3) + b"/k1" == EXAMPLES[Op.WAIT][1]
    assert codec.wait_then_get(b"/k1") == EXAMPLES[Op.WAIT][1] + EXAMPLES[Op.GET][1]


def test_the_client_builds_no_request_of_its_own():
    """Every request is encoded in codec.py: the client modules pack no bytes themselves (they
    only unpack replies), so a layout cannot be written down twice."""
    import ast
    import pathlib

    import distlib.store.tcp as package

    root = pathlib.Path(package.__file__).parent
    packing = []
    for name in ("client.py", "client_channel.py", "handshake.py", "connect.py", "in_process.py"):
        tree = ast.parse((root / name).read_text())
        packing += [f"{name}:{node.lineno}" for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and node.attr in ("pack", "pack_into")]
    assert packing == [], f"requests packed outside codec.py at {packing}"


def test_the_server_has_a_handler_for_every_opcode_and_only_those():
    table = Handlers(KeyValueState(lambda waiter: None), LIMITS, lambda conn, n: None).table()
    unknown = table[0xFF]
    assert {op for op in range(256) if table[op] != unknown} == set(REQUESTS)
