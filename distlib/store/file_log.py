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

Some records are damage whatever follows them, and ``replay`` stops before those too
(``record_problem`` says why): an empty key (torch never writes one: ``set("")`` writes the
key ``/``, and torch's own ``list_keys`` fails on an empty key; zero bytes appended to the
file, a hole, read as exactly such records), a key longer than ``MAX_KEY`` or a value longer
than ``MAX_VALUE``. The limits keep a reader from trusting a garbled length field: it never
sets out to read gigabytes because four bytes said so.

``replay`` is the hot path of a new client joining a big store (every record of the file is
parsed once), hence a tight loop over ``struct.unpack_from`` with no per-record function
calls.
"""

from __future__ import annotations

import struct
from typing import Dict, Iterator, MutableMapping, Optional, Tuple

from ..errors import DistStoreError

_U32 = struct.Struct("<I")
_pack_u32 = _U32.pack
_unpack_u32 = _U32.unpack_from

#: Size of each length field (FileStore uses 4 bytes; TCPStore's blobs use 8).
LENGTH_SIZE = 4
#: Largest key or value one record can hold (a u32 length).
MAX_FIELD = 2**32 - 1
#: Largest key distlib writes or reads (with its ``/`` or ``-/``). Real keys are short (the
#: longest torch writes are nested PrefixStore keys of some 100 bytes); a larger key length
#: is a garbled field, and writing one is refused.
MAX_KEY = 64 * 1024
#: Largest value distlib writes or reads. torch sets no limit; values stored by process
#: groups are addresses, ids and counters (the TCP store refuses more than 8 MiB). A larger
#: value length is read as damage, and writing one is refused.
MAX_VALUE = 256 * 1024 * 1024
#: Bytes of the header of a record: the key length and the value length.
HEADER_SIZE = 2 * LENGTH_SIZE

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
    check_sizes(key, value)
    return _pack_u32(len(key)) + key + _pack_u32(len(value)) + value


def check_sizes(key: bytes, value: bytes) -> None:
    """Refuse a record a reader would call damage (empty key, key or value over the limits)."""
    if not key or len(key) > MAX_KEY or len(value) > MAX_VALUE:
        raise ValueError(
            f"FileStore record refused: key {len(key)} bytes, value {len(value)} bytes "
            f"(a key has 1 to {MAX_KEY} bytes, a value at most {MAX_VALUE} bytes)"
        )


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
    for later, or reports damage) or a record is damage whatever follows it
    (``record_problem`` tells the two apart). ``data`` may be bytes, bytearray or memoryview (the
    latter two are copied once: slices become dict keys).
    """
    if type(data) is not bytes:
        data = bytes(data)  # bytearray/memoryview slices cannot be dict keys
    if end is None:
        end = len(data)
    unpack = _unpack_u32
    max_key = MAX_KEY
    max_value = MAX_VALUE
    pos = start
    while pos + 4 <= end:
        key_len = unpack(data, pos)[0]
        if not 0 < key_len <= max_key:
            break  # damage (record_problem)
        key_start = pos + 4
        key_end = key_start + key_len
        if key_end + 4 > end:
            break
        value_len = unpack(data, key_end)[0]
        if value_len > max_value:
            break  # damage (record_problem)
        value_start = key_end + 4
        value_end = value_start + value_len
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

    Stops silently before an incomplete trailing record or a damaged one; compare
    ``record_end`` with ``len(data)`` to tell.
    """
    pos = start
    end = len(data)
    while pos + 4 <= end:
        key_len = _unpack_u32(data, pos)[0]
        if not 0 < key_len <= MAX_KEY:
            return
        key_end = pos + 4 + key_len
        if key_end + 4 > end:
            return
        value_len = _unpack_u32(data, key_end)[0]
        if value_len > MAX_VALUE:
            return
        value_end = key_end + 4 + value_len
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


def record_problem(data: bytes, offset: int) -> Optional[str]:
    """Why the record at ``data[offset:]`` is damage whatever bytes follow, or None.

    None means the record is whole or merely incomplete: more bytes could complete it. The
    fields are checked as far as ``data`` holds them (a key length alone can already be
    wrong).
    """
    end = len(data)
    if offset + 4 > end:
        return None
    key_len = _unpack_u32(data, offset)[0]
    if key_len == 0:
        if data[offset : offset + HEADER_SIZE] == bytes(min(HEADER_SIZE, end - offset)):
            return (
                "zero bytes where a record should start (a record of an empty key and an "
                "empty value, which no FileStore writes: zeros appended to the file, or a hole)"
            )
        return "a record with an empty key, which no FileStore writes (every key is at least 1 byte)"
    if key_len > MAX_KEY:
        return f"a record announces a {key_len}-byte key, beyond the {MAX_KEY}-byte limit on keys"
    key_end = offset + 4 + key_len
    if key_end + 4 > end:
        return None
    value_len = _unpack_u32(data, key_end)[0]
    if value_len > MAX_VALUE:
        return f"a record announces a {value_len}-byte value, beyond the {MAX_VALUE}-byte limit on values"
    return None


def record_need(data: bytes, offset: int) -> int:
    """How many bytes the record at ``data[offset:]`` has at least (known from its fields so
    far); at least one more than ``len(data) - offset`` when it is incomplete."""
    have = len(data) - offset
    if have < 4:
        return 4
    key_end = 4 + _unpack_u32(data, offset)[0]
    if have < key_end + 4:
        return key_end + 4
    return key_end + 4 + _unpack_u32(data, offset + key_end)[0]


def describe_damage(data: bytes, offset: int) -> str:
    """Say what is wrong with the record at ``data[offset:]`` (``data`` reaches EOF), for
    error texts: a record that is damage whatever follows, or one cut short."""
    problem = record_problem(data, offset)
    if problem is not None:
        return problem
    rest = len(data) - offset
    if rest < 4:
        return f"{rest} stray byte(s) where a record's key length should start"
    key_len = _unpack_u32(data, offset)[0]
    if offset + 4 + key_len + 4 > len(data):
        return f"a record announces a {key_len}-byte key but only {rest - 4} byte(s) follow"
    value_len = _unpack_u32(data, offset + 4 + key_len)[0]
    have = len(data) - (offset + 8 + key_len)
    return f"a record announces a {value_len}-byte value but only {have} byte(s) follow"


def parse(data: bytes, name: str = "store file") -> Dict[bytes, bytes]:
    """The live entries of a whole file image, or DistStoreError naming the byte offset of
    the first damaged or cut-short record (for tools, and the model of what readers do)."""
    cache: Dict[bytes, bytes] = {}
    done = replay(data, cache)
    if done != len(data):
        raise DistStoreError(f"FileStore: {name} is damaged at byte {done}: {describe_damage(data, done)}")
    return cache


class _Discard(dict):
    """A mapping that forgets what it is given (``record_end`` only wants the offset)."""

    def __setitem__(self, key, value) -> None:
        pass


__all__ = [
    "LENGTH_SIZE",
    "MAX_FIELD",
    "MAX_KEY",
    "MAX_VALUE",
    "HEADER_SIZE",
    "USER_PREFIX",
    "TOMBSTONE_PREFIX",
    "REFCOUNT_KEY",
    "CLEANUP_KEY",
    "user_key",
    "tombstone_key",
    "encode_record",
    "encode_records",
    "check_sizes",
    "replay",
    "iter_records",
    "record_end",
    "load",
    "record_problem",
    "record_need",
    "describe_damage",
    "parse",
]
