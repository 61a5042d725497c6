"""The on-disk format of FileStore: torch 2.13's append-only record log (no I/O here).

A store file is a sequence of records, with no header, no footer and no checksum::

    +----------------+-----------+------------------+-------------+
    | u32 LE key len | key bytes | u32 LE value len | value bytes |   repeated to EOF
    +----------------+-----------+------------------+-------------+

Example: the record ``/a`` = ``hello`` is the 15 bytes
``02 00 00 00 2f 61 05 00 00 00 68 65 6c 6c 6f``.

Keys inside the file (docs/wire-protocol.md, "FileStore"):

================  ===========================================================================
``/`` + key       a value of the user key ``key`` (a PrefixStore key ``pre/k`` is ``/pre/k``)
``-/`` + key      a tombstone: deletes ``/`` + key; its value is empty
``refcount/``     decimal ASCII: how many FileStore objects use the file now
``cleanup/``      decimal ASCII: how many FileStore objects have been closed (destroyed)
================  ===========================================================================

Replaying the log from the start gives the store's contents: a record whose key begins with
``-`` removes the entry named by the rest of its key, any other record sets its key (the last
record of a key wins). ``add`` writes the new total as a full record, ``compare_set`` writes
only when it changes the value, ``delete_key`` always writes a tombstone.

Writers append whole records under an exclusive ``flock``, so a reader holding the lock never
sees half a record; ``replay`` still stops before an incomplete trailing record and says how
far it got, and the caller decides whether the remainder is a writer in progress (never, when
the reader holds the lock) or damage.

``replay`` is the hot path of a new client joining a big store (every record of the file is
parsed once), hence a tight loop over ``struct.unpack_from`` with no per-record function
calls.
"""

from __future__ import annotations

import struct
from typing import Dict, Iterator, MutableMapping, Optional, Tuple

_U32 = struct.Struct("<I")
_pack_u32 = _U32.pack
_unpack_u32 = _U32.unpack_from

#: Size of each length field (FileStore uses 4 bytes; TCPStore's blobs use 8).
LENGTH_SIZE = 4
#: Largest key or value one record can hold (a u32 length).
MAX_FIELD = 2**32 - 1

#: Prefix of every user key in the file.
USER_PREFIX = b"/"
#: Prefix of a tombstone key (followed by the key it deletes, ``/`` included).
TOMBSTONE_PREFIX = b"-"
#: torch's internal counters, counted by ``num_keys`` and shown (mangled) by ``list_keys``.
REFCOUNT_KEY = b"refcount/"
CLEANUP_KEY = b"cleanup/"


def user_key(key: str) -> bytes:
    """The file key of user key ``key``: ``/`` + its UTF-8 bytes."""
    return USER_PREFIX + key.encode("utf-8")


def tombstone_key(file_key: bytes) -> bytes:
    """The key of the record that deletes ``file_key`` (``/k`` → ``-/k``)."""
    return TOMBSTONE_PREFIX + file_key


def encode_record(key: bytes, value: bytes) -> bytes:
    """One record: u32 LE key length, key, u32 LE value length, value."""
    if len(key) > MAX_FIELD or len(value) > MAX_FIELD:
        raise ValueError(
            f"FileStore record too large: key {len(key)} bytes, value {len(value)} bytes "
            f"(each is limited to {MAX_FIELD} bytes by its u32 length)"
        )
    return _pack_u32(len(key)) + key + _pack_u32(len(value)) + value


def encode_records(items) -> bytes:
    """Several records back to back (``items``: (key, value) pairs)."""
    return b"".join(encode_record(k, v) for k, v in items)


def replay(
    data: bytes,
    cache: MutableMapping[bytes, bytes],
    start: int = 0,
    end: Optional[int] = None,
) -> int:
    """Apply the records in ``data[start:end]`` to ``cache``; return where parsing stopped.

    ``cache`` maps file keys (``/k``, ``refcount/``, ...) to values. The return value is the
    offset just past the last complete record: equal to ``end`` when the region held only
    whole records, smaller when an incomplete record trails (the caller keeps those bytes
    for later, or reports damage). ``data`` may be bytes, bytearray or memoryview (the
    latter two are copied once: slices become dict keys).
    """
    if type(data) is not bytes:
        data = bytes(data)  # bytearray/memoryview slices cannot be dict keys
    if end is None:
        end = len(data)
    unpack = _unpack_u32
    pos = start
    while pos + 4 <= end:
        key_start = pos + 4
        key_end = key_start + unpack(data, pos)[0]
        if key_end + 4 > end:
            break
        value_start = key_end + 4
        value_end = value_start + unpack(data, key_end)[0]
        if value_end > end:
            break
        key = data[key_start:key_end]
        if key[:1] == b"-":
            cache.pop(key[1:], None)
        else:
            cache[key] = data[value_start:value_end]
        pos = value_end
    return pos


def iter_records(data: bytes, start: int = 0) -> Iterator[Tuple[int, bytes, bytes]]:
    """Yield ``(offset, key, value)`` for every complete record (for tools and tests).

    Stops silently before an incomplete trailing record; compare ``record_end`` with
    ``len(data)`` to tell.
    """
    pos = start
    end = len(data)
    while pos + 4 <= end:
        key_end = pos + 4 + _unpack_u32(data, pos)[0]
        if key_end + 4 > end:
            return
        value_end = key_end + 4 + _unpack_u32(data, key_end)[0]
        if value_end > end:
            return
        yield pos, bytes(data[pos + 4 : key_end]), bytes(data[key_end + 4 : value_end])
        pos = value_end


def record_end(data: bytes, start: int = 0) -> int:
    """Offset just past the last complete record of ``data`` (``len(data)`` when intact)."""
    return replay(data, _Discard(), start)


def load(data: bytes) -> Dict[bytes, bytes]:
    """The live entries of a whole file image (tombstones applied), in insertion order."""
    cache: Dict[bytes, bytes] = {}
    replay(data, cache)
    return cache


def describe_damage(data: bytes, offset: int) -> str:
    """Say what is wrong with the incomplete record at ``data[offset:]``, for error texts."""
    rest = len(data) - offset
    if rest < 4:
        return f"{rest} stray byte(s) where a record's key length should start"
    key_len = _unpack_u32(data, offset)[0]
    if offset + 4 + key_len + 4 > len(data):
        return f"a record announces a {key_len}-byte key but only {rest - 4} byte(s) follow"
    value_len = _unpack_u32(data, offset + 4 + key_len)[0]
    have = len(data) - (offset + 8 + key_len)
    return f"a record announces a {value_len}-byte value but only {have} byte(s) follow"


class _Discard(dict):
    """A mapping that forgets what it is given (``record_end`` only wants the offset)."""

    def __setitem__(self, key, value) -> None:
        pass


__all__ = [
    "LENGTH_SIZE",
    "MAX_FIELD",
    "USER_PREFIX",
    "TOMBSTONE_PREFIX",
    "REFCOUNT_KEY",
    "CLEANUP_KEY",
    "user_key",
    "tombstone_key",
    "encode_record",
    "encode_records",
    "replay",
    "iter_records",
    "record_end",
    "load",
    "describe_damage",
]
