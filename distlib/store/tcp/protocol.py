"""The c10d TCPStore wire protocol (torch 2.13), in one place.

Checked against ../shared/spec/c10d-store-protocol.md §1 and its captures. All integers are
little-endian. There is no frame header: a request is an opcode byte followed by its fields,
a response is just its fields, and each side knows from the request what comes back.

Types::

    u8    1 byte                 opcode; CHECK/WAIT response codes
    u32   4 bytes LE             VALIDATE magic, PING nonce
    i64   8 bytes LE signed      ADD delta and result, counts in replies
    u64   8 bytes LE unsigned    key counts in requests
    blob  u64 length n + n bytes keys and values (no terminator, binary safe)

Requests (C→S) and responses (S→C)::

    op    name          request body                        response
    0x00  VALIDATE      u32 magic 0x3C85F7CE                 (nothing)       must come first
    0x01  SET           blob key, blob value                 (nothing)
    0x02  COMPARE_SET   blob key, blob expected, blob desired  blob
    0x03  GET           blob key                             blob
    0x04  ADD           blob key, i64 delta                  i64 new value
    0x05  CHECK         u64 n, n x blob key                  u8 0 READY / 1 NOT_READY
    0x06  WAIT          u64 n, n x blob key                  u8 0 STOP_WAITING (deferred)
    0x07  GETNUMKEYS    -                                    i64
    0x08  DELETE_KEY    blob key                             i64 1 deleted / 0 absent
    0x09  APPEND        blob key, blob value                 (nothing)
    0x0A  MULTI_GET     u64 n, n x blob key                  n x blob
    0x0B  MULTI_SET     u64 n, n x (blob key, blob value)    (nothing)
    0x0C  CANCEL_WAIT   -                                    u8 1 WAIT_CANCELED (after a u8 0
                                                             if the wait had just completed)
    0x0D  PING          u32 nonce                            u32 nonce
    0x0E  QUEUE_PUSH    blob key, blob value                 (nothing)
    0x0F  QUEUE_POP     blob key                             i64 length before pop, then a
                                                             blob if it was > 0
    0x10  QUEUE_LEN     blob key                             i64
    0x11  LIST_KEYS     -                                    i64 n, n x blob
    0x12  BARRIER       blob key, i64 world_size             u8 0 STOP_WAITING (deferred)

Handshake: the client sends VALIDATE (5 bytes, one write) then PING with its pid as nonce
and reads the 4-byte echo. A torch client then sends ``ADD "init/" 1`` when it was created
with a world_size and wait_for_workers=True. torch clients put ``/`` in front of every user
key; ``init/`` is the one key written without it.

**distlib's ordered-wait capability.** A distlib server runs each connection's requests in
order: a request that follows a pending WAIT or BARRIER on the same connection runs when
that wait completes (CANCEL_WAIT excepted: it runs at once). torch clients never send
anything behind a pending wait except CANCEL_WAIT, so for them nothing changes. A distlib
client detects the capability by adding, to its handshake write, a CHECK of the single
reserved key ``ORDERED_WAIT_PROBE_KEY`` (it starts with a NUL byte, so no torch key can
collide with it): a distlib server answers READY without storing the key, a torch server
answers NOT_READY. With the capability, ``get`` is ``WAIT k`` + ``GET k`` in one write and
one round trip instead of torch's two; without it, the client behaves exactly as torch's.
"""

from __future__ import annotations

import enum
import struct
from typing import List, Sequence

MAGIC = 0x3C85F7CE

#: The key a distlib client CHECKs during the handshake to learn that the server runs
#: each connection's requests in order (see the module docstring).
ORDERED_WAIT_PROBE_KEY = b"\x00distlib/ordered-wait/v1"

#: The worker counter written (without a leading slash) by clients with wait_for_workers.
WORKER_COUNTER_KEY = b"init/"

# Size limits a distlib server enforces by default: the same as torch's libuv server, so a
# torch client that works against one works against the other. An oversized length closes
# that client's connection as soon as the length field is read.
MAX_KEY_BYTES = 8192
MAX_VALUE_BYTES = 8 * 1024 * 1024
MAX_KEYS_PER_REQUEST = 131072


class Op(enum.IntEnum):
    VALIDATE = 0x00
    SET = 0x01
    COMPARE_SET = 0x02
    GET = 0x03
    ADD = 0x04
    CHECK = 0x05
    WAIT = 0x06
    GETNUMKEYS = 0x07
    DELETE_KEY = 0x08
    APPEND = 0x09
    MULTI_GET = 0x0A
    MULTI_SET = 0x0B
    CANCEL_WAIT = 0x0C
    PING = 0x0D
    QUEUE_PUSH = 0x0E
    QUEUE_POP = 0x0F
    QUEUE_LEN = 0x10
    LIST_KEYS = 0x11
    BARRIER = 0x12


READY = 0  # CHECK: every key exists  (READY is 0, NOT_READY is 1: easy to get backwards)
NOT_READY = 1
STOP_WAITING = 0  # WAIT / BARRIER completed
WAIT_CANCELED = 1  # reply to CANCEL_WAIT

U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
U64 = struct.Struct("<Q")
OP_U32 = struct.Struct("<BI")
OP_U64 = struct.Struct("<BQ")


class ProtocolError(Exception):
    """A peer sent bytes that are not a valid request or response."""


# -- encoding (used by clients; the server encodes its few replies inline) -------------------


def blob(data: bytes) -> bytes:
    return U64.pack(len(data)) + data


def blobs(items: Sequence[bytes]) -> bytes:
    return b"".join(U64.pack(len(d)) + d for d in items)


def validate() -> bytes:
    return OP_U32.pack(Op.VALIDATE, MAGIC)


def ping(nonce: int) -> bytes:
    return OP_U32.pack(Op.PING, nonce & 0xFFFFFFFF)


def set_(key: bytes, value: bytes) -> bytes:
    return OP_U64.pack(Op.SET, len(key)) + key + U64.pack(len(value)) + value


def compare_set(key: bytes, expected: bytes, desired: bytes) -> bytes:
    return bytes([Op.COMPARE_SET]) + blob(key) + blob(expected) + blob(desired)


def get(key: bytes) -> bytes:
    return OP_U64.pack(Op.GET, len(key)) + key


def add(key: bytes, delta: int) -> bytes:
    return OP_U64.pack(Op.ADD, len(key)) + key + I64.pack(delta)


def keys_request(op: Op, keys: Sequence[bytes]) -> bytes:
    """CHECK, WAIT and MULTI_GET: u64 count then the key blobs."""
    return OP_U64.pack(op, len(keys)) + blobs(keys)


def no_body(op: Op) -> bytes:
    """GETNUMKEYS, CANCEL_WAIT, LIST_KEYS."""
    return bytes([op])


def key_request(op: Op, key: bytes) -> bytes:
    """GET, DELETE_KEY, QUEUE_POP, QUEUE_LEN: one key blob."""
    return OP_U64.pack(op, len(key)) + key


def key_value_request(op: Op, key: bytes, value: bytes) -> bytes:
    """SET, APPEND, QUEUE_PUSH: key blob then value blob."""
    return OP_U64.pack(op, len(key)) + key + U64.pack(len(value)) + value


def multi_set(keys: Sequence[bytes], values: Sequence[bytes]) -> bytes:
    parts: List[bytes] = [OP_U64.pack(Op.MULTI_SET, len(keys))]
    for k, v in zip(keys, values):
        parts.append(U64.pack(len(k)) + k + U64.pack(len(v)) + v)
    return b"".join(parts)


def barrier(key: bytes, world_size: int) -> bytes:
    return OP_U64.pack(Op.BARRIER, len(key)) + key + I64.pack(world_size)


# -- decoding requests (used by the server) ---------------------------------------------------


class Limits:
    """The caps a server enforces on what one request may carry."""

    __slots__ = ("max_key", "max_value", "max_keys")

    def __init__(
        self,
        max_key: int = MAX_KEY_BYTES,
        max_value: int = MAX_VALUE_BYTES,
        max_keys: int = MAX_KEYS_PER_REQUEST,
    ):
        self.max_key = max_key
        self.max_value = max_value
        self.max_keys = max_keys


_u64_from = U64.unpack_from
_i64_from = I64.unpack_from
_u32_from = U32.unpack_from


def _blob_at(buf, pos: int, end: int, cap: int, what: str):
    """(bytes, new_pos), or None if the buffer ends first. Raises ProtocolError over ``cap``."""
    if pos + 8 > end:
        return None
    (n,) = _u64_from(buf, pos)
    if n > cap:
        raise ProtocolError(f"{what} of {n} bytes exceeds the limit of {cap} bytes")
    pos += 8
    if pos + n > end:
        return None
    return bytes(buf[pos : pos + n]), pos + n


def _count_at(buf, pos: int, end: int, cap: int):
    if pos + 8 > end:
        return None
    (n,) = _u64_from(buf, pos)
    if n > cap:
        raise ProtocolError(f"request lists {n} keys, over the limit of {cap}")
    return n, pos + 8


def parse_request(buf, pos: int, end: int, limits: Limits):
    """Parse one request starting at ``buf[pos]``.

    Returns ``(op, args, new_pos)`` or None when the buffer holds only part of the request.
    ``args`` is a tuple whose shape depends on the opcode. Raises ProtocolError for an
    unknown opcode or a length over the limits (checked as soon as the length is read, so a
    huge length never makes the server wait for, or buffer, the bytes it announces).
    """
    op = buf[pos]
    p = pos + 1
    if op == Op.SET or op == Op.APPEND or op == Op.QUEUE_PUSH:
        r = _blob_at(buf, p, end, limits.max_key, "key")
        if r is None:
            return None
        key, p = r
        r = _blob_at(buf, p, end, limits.max_value, "value")
        if r is None:
            return None
        return op, (key, r[0]), r[1]
    if op == Op.GET or op == Op.DELETE_KEY or op == Op.QUEUE_POP or op == Op.QUEUE_LEN:
        r = _blob_at(buf, p, end, limits.max_key, "key")
        if r is None:
            return None
        return op, (r[0],), r[1]
    if op == Op.ADD or op == Op.BARRIER:
        r = _blob_at(buf, p, end, limits.max_key, "key")
        if r is None:
            return None
        key, p = r
        if p + 8 > end:
            return None
        return op, (key, _i64_from(buf, p)[0]), p + 8
    if op == Op.CHECK or op == Op.WAIT or op == Op.MULTI_GET:
        r = _count_at(buf, p, end, limits.max_keys)
        if r is None:
            return None
        n, p = r
        keys = []
        for _ in range(n):
            r = _blob_at(buf, p, end, limits.max_key, "key")
            if r is None:
                return None
            keys.append(r[0])
            p = r[1]
        return op, (keys,), p
    if op == Op.COMPARE_SET:
        r = _blob_at(buf, p, end, limits.max_key, "key")
        if r is None:
            return None
        key, p = r
        r = _blob_at(buf, p, end, limits.max_value, "expected value")
        if r is None:
            return None
        expected, p = r
        r = _blob_at(buf, p, end, limits.max_value, "desired value")
        if r is None:
            return None
        return op, (key, expected, r[0]), r[1]
    if op == Op.MULTI_SET:
        r = _count_at(buf, p, end, limits.max_keys)
        if r is None:
            return None
        n, p = r
        pairs = []
        for _ in range(n):
            r = _blob_at(buf, p, end, limits.max_key, "key")
            if r is None:
                return None
            key, p = r
            r = _blob_at(buf, p, end, limits.max_value, "value")
            if r is None:
                return None
            pairs.append((key, r[0]))
            p = r[1]
        return op, (pairs,), p
    if op == Op.PING or op == Op.VALIDATE:
        if p + 4 > end:
            return None
        return op, (_u32_from(buf, p)[0],), p + 4
    if op == Op.GETNUMKEYS or op == Op.CANCEL_WAIT or op == Op.LIST_KEYS:
        return op, (), p
    raise ProtocolError(f"unknown opcode 0x{op:02x}")


def request_end(buf, pos: int, end: int, limits: Limits) -> int:
    """Where the request starting at ``buf[pos]`` ends, without decoding it.

    Returns the offset just past the request, or ``-need`` when the buffer ends first
    (``need`` = how many bytes from the start of ``buf`` are needed before it is worth
    looking again). Raises ProtocolError as parse_request does (unknown opcode, a length
    over the limits, checked as soon as the length field is there).
    """
    op = buf[pos]
    p = pos + 1
    kind = _SHAPES.get(op)
    if kind is None:
        raise ProtocolError(f"unknown opcode 0x{op:02x}")
    if kind == "u32":
        return p + 4 if p + 4 <= end else -(p + 4)
    if kind == "none":
        return p
    if kind == "keys" or kind == "pairs":
        if p + 8 > end:
            return -(p + 8)
        (n,) = _u64_from(buf, p)
        if n > limits.max_keys:
            raise ProtocolError(f"request lists {n} keys, over the limit of {limits.max_keys}")
        p += 8
        caps = ((limits.max_key, "key"),) if kind == "keys" else ((limits.max_key, "key"), (limits.max_value, "value"))
        for _ in range(n):
            for cap, what in caps:
                p = _skip_blob(buf, p, end, cap, what)
                if p < 0:
                    return p
        return p
    for cap_name, what in kind:
        if cap_name == "i64":
            p += 8
            if p > end:
                return -p
            continue
        p = _skip_blob(buf, p, end, getattr(limits, cap_name), what)
        if p < 0:
            return p
    return p


def _skip_blob(buf, p: int, end: int, cap: int, what: str) -> int:
    if p + 8 > end:
        return -(p + 8)
    (n,) = _u64_from(buf, p)
    if n > cap:
        raise ProtocolError(f"{what} of {n} bytes exceeds the limit of {cap} bytes")
    p += 8 + n
    return p if p <= end else -p


_KEY = ("max_key", "key")
_VALUE = ("max_value", "value")
_I64 = ("i64", "")
#: The shape of each request body, for request_end.
_SHAPES = {
    Op.VALIDATE: "u32", Op.PING: "u32",
    Op.GETNUMKEYS: "none", Op.CANCEL_WAIT: "none", Op.LIST_KEYS: "none",
    Op.CHECK: "keys", Op.WAIT: "keys", Op.MULTI_GET: "keys", Op.MULTI_SET: "pairs",
    Op.SET: (_KEY, _VALUE), Op.APPEND: (_KEY, _VALUE), Op.QUEUE_PUSH: (_KEY, _VALUE),
    Op.GET: (_KEY,), Op.DELETE_KEY: (_KEY,), Op.QUEUE_POP: (_KEY,), Op.QUEUE_LEN: (_KEY,),
    Op.ADD: (_KEY, _I64), Op.BARRIER: (_KEY, _I64),
    Op.COMPARE_SET: (_KEY, ("max_value", "expected value"), ("max_value", "desired value")),
}
_SHAPES = {int(k): v for k, v in _SHAPES.items()}


def describe_key(key: bytes) -> str:
    """A key for log lines and errors: text when it is text, escaped bytes otherwise."""
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return repr(key)
    return text if text.isprintable() else repr(key)
