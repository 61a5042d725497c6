"""The journal's bytes: frames (length, crc32, payload) holding the records of the changes a
store server made, and reading them back into an ``Image`` (the keys, the queues, the
sessions' last replies).

A record says what a change did, not which request made it (an ADD is journaled as the SET of
the number it wrote), so that replay needs neither the waits nor the rules of state.py and
gives the same state whatever the requests were. One frame holds the records of one change
that must survive whole or not at all (a MULTI_SET's keys, a sequenced write's effect and its
session's reply): a frame is the unit a crash can tear. The snapshot of a compaction
(journal.py) is written with the same frames, so one reader serves both.

Frame: ``u32 length, u32 crc32(payload), payload`` (little-endian). Payload: records, each a
tag byte then its fields, a byte string field as ``u32 length`` + bytes:

=====  ==========================================  =============================================
tag    fields                                      meaning
=====  ==========================================  =============================================
``S``  key, value                                  key := value (SET, ADD, COMPARE_SET, ...)
``A``  key, value                                  key := key's value + value (APPEND)
``D``  key                                         key deleted
``P``  key, value                                  value pushed on queue key
``O``  key                                         queue key's front popped
``Q``  session (16 bytes), u64 seq, f64 time,      session's last applied write is seq, its
       reply                                       reply that, at wall-clock time
``X``  session (16 bytes)                          session forgotten (idle past its expiry)
=====  ==========================================  =============================================
"""

from __future__ import annotations

import collections
import struct
import zlib
from typing import Deque, Dict, List, Optional, Tuple

FRAME = struct.Struct("<II")
_U32 = struct.Struct("<I")
_KV = struct.Struct("<II")
_SESSION = struct.Struct("<16sQdI")
_crc32 = zlib.crc32

#: A frame no longer than this is believed (a length field past it is damage, not a record).
MAX_FRAME = 1 << 31


class Session:
    """One client session's last applied write: its sequence number, the reply it got, and
    when (wall-clock seconds, so that expiry survives a restart)."""

    __slots__ = ("seq", "reply", "used")

    def __init__(self, seq: int, reply: bytes, used: float):
        self.seq = seq
        self.reply = reply
        self.used = used


class Image:
    """What replaying frames builds: ``data`` (key -> value), ``queues`` (key -> deque of
    values) and ``sessions`` (session id -> Session, in order of last use)."""

    def __init__(self) -> None:
        self.data: Dict[bytes, bytes] = {}
        self.queues: Dict[bytes, Deque[bytes]] = {}
        self.sessions: "collections.OrderedDict[bytes, Session]" = collections.OrderedDict()
        self.records = 0


class BadRecord(ValueError):
    """A frame whose payload does not parse (its crc matched: a bug, not a torn write)."""


# -- writing -----------------------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    """``payload`` framed: length, crc32, the bytes."""
    return FRAME.pack(len(payload), _crc32(payload)) + payload


def set_record(key: bytes, value: bytes) -> bytes:
    return b"S" + _KV.pack(len(key), len(value)) + key + value


def append_record(key: bytes, value: bytes) -> bytes:
    return b"A" + _KV.pack(len(key), len(value)) + key + value


def delete_record(key: bytes) -> bytes:
    return b"D" + _U32.pack(len(key)) + key


def push_record(key: bytes, value: bytes) -> bytes:
    return b"P" + _KV.pack(len(key), len(value)) + key + value


def pop_record(key: bytes) -> bytes:
    return b"O" + _U32.pack(len(key)) + key


def session_record(session: bytes, seq: int, used: float, reply: bytes) -> bytes:
    return b"Q" + _SESSION.pack(session, seq, used, len(reply)) + reply


def forget_record(session: bytes) -> bytes:
    return b"X" + session


# -- reading -----------------------------------------------------------------------------------


def scan(buf, start: int) -> Tuple[List[Tuple[int, int]], int, Optional[str]]:
    """The frames of ``buf`` from ``start``: ``(spans, end, damage)``: the (start, end) of each
    good frame's payload, the offset after the last good frame, and None when the buffer ends
    there, else what is wrong at ``end``: "torn" when the rest cannot be a whole frame (a write
    cut short: a length past the end of the buffer, or a frame that ends the buffer and fails
    its crc), "corrupt" when a frame with bytes after it fails its crc."""
    spans: List[Tuple[int, int]] = []
    pos, size = start, len(buf)
    unpack = FRAME.unpack_from
    while pos < size:
        if size - pos < FRAME.size:
            return spans, pos, "torn"
        length, crc = unpack(buf, pos)
        body = pos + FRAME.size
        if length > size - body or length > MAX_FRAME:
            return spans, pos, "torn"
        if _crc32(memoryview(buf)[body:body + length]) != crc:
            return spans, pos, "torn" if body + length == size else "corrupt"
        spans.append((body, body + length))
        pos = body + length
    return spans, pos, None


def apply(image: Image, buf, start: int, end: int) -> None:
    """Apply the records of one payload ``buf[start:end]`` to ``image``. BadRecord when they
    do not parse."""
    data, queues, sessions = image.data, image.queues, image.sessions
    pos = start
    mv = memoryview(buf)
    try:
        while pos < end:
            tag = buf[pos]
            pos += 1
            if tag in _TWO_FIELDS:
                klen, vlen = _KV.unpack_from(buf, pos)
                pos += 8
                key = bytes(mv[pos:pos + klen])
                pos += klen
                value = bytes(mv[pos:pos + vlen])
                pos += vlen
                if tag == 0x53:  # S
                    data[key] = value
                elif tag == 0x41:  # A
                    old = data.get(key)
                    data[key] = value if old is None else old + value
                else:  # P
                    queues.setdefault(key, collections.deque()).append(value)
            elif tag in _ONE_FIELD:
                (klen,) = _U32.unpack_from(buf, pos)
                pos += 4
                key = bytes(mv[pos:pos + klen])
                pos += klen
                if tag == 0x44:  # D
                    data.pop(key, None)
                else:  # O
                    queue = queues.get(key)
                    if queue:
                        queue.popleft()
                        if not queue:
                            del queues[key]
            elif tag == 0x51:  # Q
                session, seq, used, rlen = _SESSION.unpack_from(buf, pos)
                pos += _SESSION.size
                reply = bytes(mv[pos:pos + rlen])
                pos += rlen
                sessions[session] = Session(seq, reply, used)
                sessions.move_to_end(session)
            elif tag == 0x58:  # X
                sessions.pop(bytes(mv[pos:pos + 16]), None)
                pos += 16
            else:
                raise BadRecord(f"unknown record tag 0x{tag:02x}")
            image.records += 1
    except struct.error as exc:
        raise BadRecord(f"a record runs past its frame ({exc})") from None
    if pos != end:
        raise BadRecord(f"a record runs {pos - end} bytes past its frame")


_TWO_FIELDS = frozenset(b"SAP")
_ONE_FIELD = frozenset(b"DO")
