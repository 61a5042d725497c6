"""The c10d TCPStore wire protocol (torch 2.13): opcodes, limits, and the one table of
request layouts that the client's encoders, the server's decoders and the batch path use.

The protocol, with the facts behind each rule, is docs/wire-protocol.md. All integers are
little-endian. There is no frame header: a request is an opcode byte followed by its fields,
a response is just its fields, and each side knows from the request what comes back.

Field types::

    u8    1 byte                 opcode; CHECK/WAIT response codes
    u32   4 bytes LE             VALIDATE magic, PING nonce
    i64   8 bytes LE signed      ADD delta and result, counts in replies
    u64   8 bytes LE unsigned    key counts in requests
    blob  u64 length n + n bytes keys and values (no terminator, binary safe)

Requests (C→S; the layout column is ``REQUESTS``) and responses (S→C)::

    op    name          layout: request body after the opcode   response
    0x00  VALIDATE      U32        u32 magic 0x3C85F7CE          (nothing)       must come first
    0x01  SET           KEY_VALUE  blob key, blob value          (nothing)
    0x02  COMPARE_SET   KEY_2BLOBS blob key, blob expected,      blob
                                   blob desired
    0x03  GET           KEY        blob key                      blob
    0x04  ADD           KEY_I64    blob key, i64 delta           i64 new value
    0x05  CHECK         KEYS       u64 n, n x blob key           u8 0 READY / 1 NOT_READY
    0x06  WAIT          KEYS       u64 n, n x blob key           u8 0 STOP_WAITING (deferred)
    0x07  GETNUMKEYS    BARE       -                             i64
    0x08  DELETE_KEY    KEY        blob key                      i64 1 deleted / 0 absent
    0x09  APPEND        KEY_VALUE  blob key, blob value          (nothing)
    0x0A  MULTI_GET     KEYS       u64 n, n x blob key           n x blob
    0x0B  MULTI_SET     PAIRS      u64 n, n x (blob, blob)       (nothing)
    0x0C  CANCEL_WAIT   BARE       -                             u8 1 WAIT_CANCELED (after a u8 0
                                                                 if the wait had just completed)
    0x0D  PING          U32        u32 nonce                     u32 nonce
    0x0E  QUEUE_PUSH    KEY_VALUE  blob key, blob value          (nothing)
    0x0F  QUEUE_POP     KEY        blob key                      i64 length before pop, then a
                                                                 blob if it was > 0
    0x10  QUEUE_LEN     KEY        blob key                      i64
    0x11  LIST_KEYS     BARE       -                             i64 n, n x blob
    0x12  BARRIER       KEY_I64    blob key, i64 world_size      u8 0 STOP_WAITING (deferred)

Worked example: ``set("k1", "v1")`` from a torch or distlib client (the key gets its ``/``)
is the 22 bytes ``01 | 03 00 00 00 00 00 00 00 | 2f 6b 31 | 02 00 00 00 00 00 00 00 | 76 31``
(opcode SET, u64 3, ``/k1``, u64 2, ``v1``) and has no reply; ``add("n", 5)`` is
``04 | 02 00 00 00 00 00 00 00 | 2f 6e | 05 00 00 00 00 00 00 00`` and the reply is the new
value as an i64, e.g. ``05 00 00 00 00 00 00 00``.

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

Each layout has one encoder and one decoder. The encoder is written once, as a factory
(``*_encoder(op)``) that returns the encoder of one opcode's requests (its fields, to bytes):
``ENCODERS`` holds one per opcode, and the named encoders a client calls (``set_``, ``get``,
...) are those. The decoder (``read_*``) turns the fields after the opcode at
``buf[p:end]`` into a tuple of the fields and the offset after them. A decoder checks each length against ``Limits`` as soon as the
length field is there (so a huge length never makes the server wait for, or buffer, the
bytes it announces) and raises ProtocolError over a limit; when the request has not fully
arrived it returns None for each field and ``-need``: the number of bytes from the start of
``buf`` needed before it is worth looking again.
"""

from __future__ import annotations

import enum
import struct
from typing import Callable, Dict, List, NamedTuple, Sequence, Tuple

MAGIC = 0x3C85F7CE

#: The key a distlib client CHECKs during the handshake to learn that the server runs
#: each connection's requests in order (see the module docstring).
ORDERED_WAIT_PROBE_KEY = b"\x00distlib/ordered-wait/v1"

#: The key of a sequence header: a SET of it (value: 16-byte session id, u64 seq, little-endian)
#: goes just before a distlib client's write that is not idempotent, in the same send, and
#: the server runs the two as one request (sessions.py; docs/wire-protocol.md).
SEQUENCE_KEY = b"\x00distlib/seq/v1"
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


#: The writes a sequence header (``SEQUENCE_KEY``) may precede: those a retry must not apply
#: twice.
SEQUENCED_OPS = frozenset({Op.ADD, Op.COMPARE_SET, Op.APPEND, Op.MULTI_SET, Op.DELETE_KEY, Op.QUEUE_PUSH,
                           Op.QUEUE_POP, Op.BARRIER})

READY = 0  # CHECK: every key exists  (READY is 0, NOT_READY is 1: easy to get backwards)
NOT_READY = 1
STOP_WAITING = 0  # WAIT / BARRIER completed
WAIT_CANCELED = 1  # reply to CANCEL_WAIT

U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
U64 = struct.Struct("<Q")
#: opcode + u32: VALIDATE, PING
OP_U32 = struct.Struct("<BI")
#: opcode + u64: the start of every request whose first field is a blob or a count
OP_U64 = struct.Struct("<BQ")
#: opcode + u64 count + u64 length of the first key: CHECK/WAIT of one key, in one call
OP_U64_U64 = struct.Struct("<BQQ")


class ProtocolError(Exception):
    """A peer sent bytes that are not a valid request or response."""


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


# -- encoders, one per layout ------------------------------------------------------------------
#
# Each factory returns the encoder of one opcode's requests, with the opcode bound in a closure:
# the client's hot paths call it directly (one Python call per request, as cheap as packing
# the bytes inline; bench/performance-log.md), and the layout is still written down once.

_pack_u64 = U64.pack
_pack_i64 = I64.pack
_pack_op_u64 = OP_U64.pack
_pack_op_u64_u64 = OP_U64_U64.pack
_pack_op_u32 = OP_U32.pack


def blob(data: bytes) -> bytes:
    return _pack_u64(len(data)) + data


def blobs(items: Sequence[bytes]) -> bytes:
    return b"".join([_pack_u64(len(d)) + d for d in items])


def bare_encoder(op: int) -> Callable[[], bytes]:
    """BARE (GETNUMKEYS, CANCEL_WAIT, LIST_KEYS): the opcode alone."""
    request = bytes((op,))

    def encode() -> bytes:
        return request
    return encode


def u32_encoder(op: int) -> Callable[[int], bytes]:
    """U32 (VALIDATE, PING): a u32."""
    def encode(value: int) -> bytes:
        return _pack_op_u32(op, value & 0xFFFFFFFF)
    return encode


def key_encoder(op: int) -> Callable[[bytes], bytes]:
    """KEY (GET, DELETE_KEY, QUEUE_POP, QUEUE_LEN): one key blob."""
    def encode(key: bytes) -> bytes:
        return _pack_op_u64(op, len(key)) + key
    return encode


def key_value_encoder(op: int) -> Callable[[bytes, bytes], bytes]:
    """KEY_VALUE (SET, APPEND, QUEUE_PUSH): key blob then value blob."""
    def encode(key: bytes, value: bytes) -> bytes:
        return _pack_op_u64(op, len(key)) + key + _pack_u64(len(value)) + value
    return encode


def key_i64_encoder(op: int) -> Callable[[bytes, int], bytes]:
    """KEY_I64 (ADD: the delta, BARRIER: the world size): key blob then an i64."""
    def encode(key: bytes, number: int) -> bytes:
        return _pack_op_u64(op, len(key)) + key + _pack_i64(number)
    return encode


def key_2blobs_encoder(op: int) -> Callable[[bytes, bytes, bytes], bytes]:
    """KEY_2BLOBS (COMPARE_SET): key blob, expected blob, desired blob."""
    def encode(key: bytes, expected: bytes, desired: bytes) -> bytes:
        return (_pack_op_u64(op, len(key)) + key + _pack_u64(len(expected)) + expected
                + _pack_u64(len(desired)) + desired)
    return encode


def keys_encoder(op: int) -> Callable[[Sequence[bytes]], bytes]:
    """KEYS (CHECK, WAIT, MULTI_GET): u64 count then the key blobs (one key, the usual
    case, in one struct call)."""
    def encode(keys: Sequence[bytes]) -> bytes:
        if len(keys) == 1:
            key = keys[0]
            return _pack_op_u64_u64(op, 1, len(key)) + key
        return _pack_op_u64(op, len(keys)) + blobs(keys)
    return encode


def pairs_encoder(op: int) -> Callable[[Sequence[bytes], Sequence[bytes]], bytes]:
    """PAIRS (MULTI_SET): u64 count then (key blob, value blob) pairs."""
    def encode(keys: Sequence[bytes], values: Sequence[bytes]) -> bytes:
        parts: List[bytes] = [_pack_op_u64(op, len(keys))]
        for k, v in zip(keys, values, strict=True):
            parts.append(_pack_u64(len(k)) + k + _pack_u64(len(v)) + v)
        return b"".join(parts)
    return encode


# -- decoders, one per layout -------------------------------------------------------------------

_u64_from = U64.unpack_from
_u64_u64_from = struct.Struct("<QQ").unpack_from
_i64_from = I64.unpack_from
_u32_from = U32.unpack_from


def _over(what: str, n: int, cap: int) -> ProtocolError:
    return ProtocolError(f"{what} of {n} bytes exceeds the limit of {cap} bytes")


def read_blob(buf, p: int, end: int, cap: int, what: str):
    """(bytes, offset after), or (None, -need)."""
    q = p + 8
    if q > end:
        return None, -q
    n = _u64_from(buf, p)[0]
    if n > cap:
        raise _over(what, n, cap)
    r = q + n
    if r > end:
        return None, -r
    return buf[q:r], r


def read_bare(buf, p: int, end: int, limits: Limits):
    """BARE: nothing after the opcode: (offset,)."""
    return (p,)


def read_u32(buf, p: int, end: int, limits: Limits):
    """U32: (value, offset after), or (None, -need)."""
    r = p + 4
    if r > end:
        return None, -r
    return _u32_from(buf, p)[0], r


def read_key(buf, p: int, end: int, limits: Limits):
    """KEY: (key, offset after), or (None, -need)."""
    q = p + 8
    if q > end:
        return None, -q
    n = _u64_from(buf, p)[0]
    if n > limits.max_key:
        raise _over("key", n, limits.max_key)
    r = q + n
    if r > end:
        return None, -r
    return buf[q:r], r


def read_key_value(buf, p: int, end: int, limits: Limits):
    """KEY_VALUE: (key, value, offset after), or (None, None, -need)."""
    q = p + 8
    if q > end:
        return None, None, -q
    n = _u64_from(buf, p)[0]
    if n > limits.max_key:
        raise _over("key", n, limits.max_key)
    r = q + n + 8
    if r > end:
        return None, None, -r
    m = _u64_from(buf, r - 8)[0]
    if m > limits.max_value:
        raise _over("value", m, limits.max_value)
    s = r + m
    if s > end:
        return None, None, -s
    return buf[q : q + n], buf[r:s], s


def read_key_i64(buf, p: int, end: int, limits: Limits):
    """KEY_I64: (key, number, offset after), or (None, None, -need)."""
    q = p + 8
    if q > end:
        return None, None, -q
    n = _u64_from(buf, p)[0]
    if n > limits.max_key:
        raise _over("key", n, limits.max_key)
    r = q + n
    s = r + 8
    if s > end:
        return None, None, -s
    return buf[q:r], _i64_from(buf, r)[0], s


def read_key_2blobs(buf, p: int, end: int, limits: Limits):
    """KEY_2BLOBS: (key, expected, desired, offset after), or (None, None, None, -need)."""
    key, p = read_key(buf, p, end, limits)
    if p < 0:
        return None, None, None, p
    expected, p = read_blob(buf, p, end, limits.max_value, "expected value")
    if p < 0:
        return None, None, None, p
    desired, p = read_blob(buf, p, end, limits.max_value, "desired value")
    if p < 0:
        return None, None, None, p
    return key, expected, desired, p


def _count(buf, p: int, end: int, limits: Limits):
    q = p + 8
    if q > end:
        return None, -q
    count = _u64_from(buf, p)[0]
    if count > limits.max_keys:
        raise ProtocolError(f"request lists {count} keys, over the limit of {limits.max_keys}")
    return count, q


def read_keys(buf, p: int, end: int, limits: Limits):
    """KEYS: (list of keys, offset after), or (None, -need)."""
    q = p + 16
    if q <= end:
        count, n = _u64_u64_from(buf, p)
        if count == 1 and n <= limits.max_key:  # the usual case: one key
            r = q + n
            if r <= end:
                return [buf[q:r]], r
    count, q = _count(buf, p, end, limits)
    if q < 0:
        return None, q
    cap = limits.max_key
    keys = []
    for _ in range(count):
        p = q + 8
        if p > end:
            return None, -p
        n = _u64_from(buf, q)[0]
        if n > cap:
            raise _over("key", n, cap)
        q = p + n
        if q > end:
            return None, -q
        keys.append(buf[p:q])
    return keys, q


def read_pairs(buf, p: int, end: int, limits: Limits):
    """PAIRS: (list of (key, value), offset after), or (None, -need)."""
    count, q = _count(buf, p, end, limits)
    if q < 0:
        return None, q
    pairs = []
    for _ in range(count):
        key, value, q = read_key_value(buf, q, end, limits)
        if q < 0:
            return None, q
        pairs.append((key, value))
    return pairs, q


class ManyScan:
    """Where a count-prefixed request (KEYS: CHECK, WAIT, MULTI_GET; PAIRS: MULTI_SET) ends,
    found over bytes that arrive in pieces, each byte looked at once.

    Why: such a request can be tens of megabytes (131072 pairs), and arrives in many reads.
    Decoding it afresh after every read, to learn whether it is complete, costs the whole
    buffer each time: quadratic. The server keeps one ManyScan per request in progress and
    hands it the buffer as it grows (the request's opcode at offset 0); ``advance`` reads only
    the length fields it has not read before, checks them against the limits as they arrive
    (ProtocolError, with the decoders' texts), and returns the request's end once every field
    is there, or ``-need`` (as the decoders do). The request is then decoded once.
    """

    __slots__ = ("pos", "left", "pairs", "index", "limits")

    def __init__(self, op: int, limits: Limits, start: int = 0):
        self.pos = start + 1  # the next length field (or the count) to read (the opcode at ``start``)
        self.left = -1  # blobs still to find; -1: the count is not read yet
        self.pairs = op == Op.MULTI_SET
        self.index = 0  # blobs found so far (in PAIRS, odd ones are values)
        self.limits = limits

    def advance(self, buf, end: int) -> int:
        p = self.pos
        limits = self.limits
        if self.left < 0:
            count, q = _count(buf, p, end, limits)
            if q < 0:
                return q
            self.left = count * 2 if self.pairs else count
            p = q
        left, index = self.left, self.index
        max_key, max_value, pairs = limits.max_key, limits.max_value, self.pairs
        try:
            while left:
                q = p + 8
                if q > end:
                    return -q
                n = _u64_from(buf, p)[0]
                if pairs and index & 1:
                    if n > max_value:
                        raise _over("value", n, max_value)
                elif n > max_key:
                    raise _over("key", n, max_key)
                r = q + n
                if r > end:
                    return -r
                p = r
                left -= 1
                index += 1
            return p
        finally:
            self.pos, self.left, self.index = p, left, index


#: The opcodes whose requests a ManyScan frames.
MANY_KEY_OPS = frozenset((Op.CHECK, Op.WAIT, Op.MULTI_GET, Op.MULTI_SET))


# -- the table ----------------------------------------------------------------------------------


class Layout(NamedTuple):
    """One request layout: its fields after the opcode, its encoder factory (opcode -> the
    encoder of that opcode's requests) and its decoder."""

    name: str
    fields: Tuple[str, ...]
    encoder: Callable[[int], Callable[..., bytes]]
    read: Callable


BARE = Layout("BARE", (), bare_encoder, read_bare)
U32_FIELD = Layout("U32", ("u32",), u32_encoder, read_u32)
KEY = Layout("KEY", ("key",), key_encoder, read_key)
KEY_VALUE = Layout("KEY_VALUE", ("key", "value"), key_value_encoder, read_key_value)
KEY_I64 = Layout("KEY_I64", ("key", "i64"), key_i64_encoder, read_key_i64)
KEY_2BLOBS = Layout("KEY_2BLOBS", ("key", "expected", "desired"), key_2blobs_encoder, read_key_2blobs)
KEYS = Layout("KEYS", ("keys",), keys_encoder, read_keys)
PAIRS = Layout("PAIRS", ("keys", "values"), pairs_encoder, read_pairs)

#: Every request's layout, by opcode (the module docstring's table).
REQUESTS: Dict[int, Layout] = {
    Op.VALIDATE: U32_FIELD,
    Op.SET: KEY_VALUE,
    Op.COMPARE_SET: KEY_2BLOBS,
    Op.GET: KEY,
    Op.ADD: KEY_I64,
    Op.CHECK: KEYS,
    Op.WAIT: KEYS,
    Op.GETNUMKEYS: BARE,
    Op.DELETE_KEY: KEY,
    Op.APPEND: KEY_VALUE,
    Op.MULTI_GET: KEYS,
    Op.MULTI_SET: PAIRS,
    Op.CANCEL_WAIT: BARE,
    Op.PING: U32_FIELD,
    Op.QUEUE_PUSH: KEY_VALUE,
    Op.QUEUE_POP: KEY,
    Op.QUEUE_LEN: KEY,
    Op.LIST_KEYS: BARE,
    Op.BARRIER: KEY_I64,
}


def _named(op: Op) -> Callable[..., bytes]:
    encode = REQUESTS[op].encoder(int(op))
    encode.__name__ = encode.__qualname__ = op.name.lower()
    encode.__doc__ = f"{op.name} ({REQUESTS[op].name}): {', '.join(REQUESTS[op].fields) or 'no fields'}, to bytes."
    return encode


#: The encoder of each opcode's requests (its layout's, with the opcode bound).
ENCODERS: Dict[int, Callable[..., bytes]] = {op: _named(Op(op)) for op in REQUESTS}


def encode(op: int, *fields) -> bytes:
    """The request ``op`` with ``fields`` (as its layout lists them)."""
    return ENCODERS[op](*fields)


# The two encoders by opcode that callers still pick at run time (the handshake, tests).


def bare_request(op: int) -> bytes:
    return ENCODERS[op]()


def keys_request(op: int, keys: Sequence[bytes]) -> bytes:
    return ENCODERS[op](keys)


def decode(buf, pos: int, end: int, limits: Limits):
    """The request at ``buf[pos]``: ``(op, fields, offset after)``, or ``(op, None, -need)``
    when it has not fully arrived. ProtocolError for an unknown opcode or a length over
    ``limits``. A PAIRS request's fields are its list of (key, value) pairs."""
    op = buf[pos]
    layout = REQUESTS.get(op)
    if layout is None:
        raise ProtocolError(f"unknown opcode 0x{op:02x}")
    out = layout.read(buf, pos + 1, end, limits)
    r = out[-1]
    return (op, None, r) if r < 0 else (op, out[:-1], r)


def request_end(buf, pos: int, end: int, limits: Limits) -> int:
    """Where the request starting at ``buf[pos]`` ends, or ``-need`` (as ``decode``); a
    sequence header ends with the write it precedes (the two are one request)."""
    op, fields, r = decode(buf, pos, end, limits)
    if r >= 0 and op == Op.SET and fields[0] == SEQUENCE_KEY:
        if r >= end:
            return -(r + 1)
        r = decode(buf, r, end, limits)[2]
    return r


# -- the requests clients send, by name ----------------------------------------------------------
#
# The client (client.py) and the handshake build every request with these (ENCODERS' entries).

_validate = ENCODERS[Op.VALIDATE]
ping = ENCODERS[Op.PING]
set_ = ENCODERS[Op.SET]
compare_set = ENCODERS[Op.COMPARE_SET]
get = ENCODERS[Op.GET]
add = ENCODERS[Op.ADD]
check = ENCODERS[Op.CHECK]
wait = ENCODERS[Op.WAIT]
getnumkeys = ENCODERS[Op.GETNUMKEYS]
delete_key = ENCODERS[Op.DELETE_KEY]
append = ENCODERS[Op.APPEND]
multi_get = ENCODERS[Op.MULTI_GET]
multi_set = ENCODERS[Op.MULTI_SET]
cancel_wait = ENCODERS[Op.CANCEL_WAIT]
queue_push = ENCODERS[Op.QUEUE_PUSH]
queue_pop = ENCODERS[Op.QUEUE_POP]
queue_len = ENCODERS[Op.QUEUE_LEN]
list_keys = ENCODERS[Op.LIST_KEYS]
barrier = ENCODERS[Op.BARRIER]


def validate() -> bytes:
    """VALIDATE with torch's magic number: the first request of every connection."""
    return _validate(MAGIC)


def wait_then_get(key: bytes) -> bytes:
    """WAIT for one key, then GET it: distlib's one-round-trip get, for a server with the
    ordered-wait capability (the module docstring)."""
    return wait((key,)) + get(key)
