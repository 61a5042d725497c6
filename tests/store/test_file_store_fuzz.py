"""A bounded fuzz of FileStore's record reader (hypothesis), run by `make test`.

Bytes go through the reader FileStore operations use (``LogFile.catch_up``: bounded reads
under the lock, parsing as the bytes arrive, the damage and truncation checks) on a real
file, and through ``file_log.parse``, the whole-image model of it. Inputs are logs of valid
records mixed with cut, spliced, zeroed and random bytes, some with length fields far
beyond the file's size.

What must hold, whatever the bytes:

* the reader gives the records, or a DistStoreError naming the byte offset of the first bad
  record; never another exception. The bytes before that offset parse cleanly, and the
  reader and the model agree on the records and on the offset;
* how the bytes reach the file does not matter: appended in pieces, with reads in between
  (errors on the way allowed, for records cut short at a piece's end), the last read gives
  what one read of the whole file gives;
* reading allocates in proportion to the bytes in the file, never to what a length field
  announces;
* a valid log (set, delete, refcount records) round-trips: the reader's contents are the
  dictionary the operations describe.

Each property runs a bounded number of examples (``EXAMPLES``); the module takes a few
seconds on the 2-core reference machine. A failure prints the reproducing example.
"""

from __future__ import annotations

import itertools
import os
import re
import struct
import tracemalloc

import pytest

pytest.importorskip("hypothesis", reason="the fuzz needs hypothesis (the test extras)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from distlib import DistStoreError  # noqa: E402
from distlib.store import file_log  # noqa: E402
from distlib.store.file_io import _RD_FLAGS, LogFile  # noqa: E402
from distlib.store.file_locks import LOCK_SH, lock, unlock_close  # noqa: E402

EXAMPLES = 500
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

_AT_BYTE = re.compile(r"damaged at byte (\d+): ")

keys = st.one_of(
    st.binary(min_size=0, max_size=12).map(lambda k: b"/" + k),
    st.binary(min_size=0, max_size=12).map(lambda k: b"-/" + k),
    st.sampled_from([file_log.REFCOUNT_KEY, file_log.CLEANUP_KEY]),
)
values = st.binary(max_size=40)
records = st.builds(file_log.encode_record, keys, values)
#: Length fields that lie: zero, just past the data, at and over the limits, the u32 top.
lengths = st.one_of(
    st.integers(0, 64),
    st.sampled_from([file_log.MAX_KEY, file_log.MAX_KEY + 1, file_log.MAX_VALUE,
                     file_log.MAX_VALUE + 1, 2 ** 31, 2 ** 32 - 1]),
    st.integers(0, 2 ** 32 - 1),
)


@st.composite
def logs(draw):
    """A store file's bytes: mostly whole records, some cut, changed, zeroed or lying."""
    parts = []
    for _ in range(draw(st.integers(0, 10))):
        kind = draw(st.integers(0, 11))
        record = draw(records)
        if kind == 0:
            parts.append(draw(st.binary(max_size=24)))  # noise
        elif kind == 1:
            parts.append(record[: draw(st.integers(0, len(record)))])  # cut short
        elif kind == 2:  # a byte changed
            i = draw(st.integers(0, len(record) - 1))
            parts.append(record[:i] + bytes([draw(st.integers(0, 255))]) + record[i + 1:])
        elif kind == 3:
            parts.append(bytes(draw(st.integers(1, 20))))  # zeros (appended, a hole)
        elif kind == 4:  # a length field that lies
            field = draw(st.sampled_from([0, 1]))
            key_len = struct.unpack_from("<I", record)[0]
            at = 0 if field == 0 else 4 + key_len
            parts.append(record[:at] + struct.pack("<I", draw(lengths)) + record[at + 4:])
        else:
            parts.append(record)
    return b"".join(parts)


_names = itertools.count()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def reader(path: str, chunk: int) -> LogFile:
    """A LogFile that reads ``path`` as an operation does (no join: no refcount record)."""
    log = LogFile(path, -1, 5.0)
    log.chunk = chunk
    st_ = os.stat(path)
    log.identity = (st_.st_dev, st_.st_ino)
    return log


def read(log: LogFile):
    """One operation's read (LOCK_SH): the contents, or the DistStoreError's offset."""
    fd = os.open(log.path, _RD_FLAGS)
    try:
        lock(fd, LOCK_SH, log.path, 5.0)
        log.catch_up(fd)
    except DistStoreError as exc:
        match = _AT_BYTE.search(str(exc))
        assert match, f"a reader error that names no offset: {exc}"
        assert log.path in str(exc)
        return int(match.group(1))
    finally:
        unlock_close(fd)
    return dict(log.cache)


def model(data: bytes):
    """file_log.parse: the contents, or the offset its DistStoreError names."""
    try:
        return file_log.parse(data)
    except DistStoreError as exc:
        match = _AT_BYTE.search(str(exc))
        assert match, f"a parse error that names no offset: {exc}"
        return int(match.group(1))


def new_file(folder, data: bytes) -> str:
    path = str(folder / f"log{next(_names)}")
    with open(path, "wb") as f:
        f.write(data)
    return path


@FUZZ
@given(logs())
def test_the_model_gives_records_or_the_offset_of_the_first_bad_one(data):
    outcome = model(data)
    if isinstance(outcome, int):
        assert 0 <= outcome < len(data)
        assert isinstance(model(data[:outcome]), dict)  # the bytes before it are whole records
        described = file_log.describe_damage(data, outcome)
        assert described and "None" not in described
    else:
        assert outcome == file_log.load(data)
        assert file_log.record_end(data) == len(data)
        # the records it found are all of the bytes: encoding them again gives the file
        assert file_log.encode_records((k, v) for _, k, v in file_log.iter_records(data)) == data


@FUZZ
@given(logs(), st.integers(1, 64), st.data())
def test_the_reader_agrees_with_the_model_whole_or_in_pieces(folder, data, chunk, draw):
    expected = model(data)
    path = new_file(folder, data)
    try:
        assert read(reader(path, chunk)) == expected
        # the same bytes appended in pieces, read after each: the last read agrees
        cuts = sorted(set(draw.draw(st.lists(st.integers(0, len(data)), max_size=6))))
        with open(path, "wb"):
            pass
        log = reader(path, chunk)
        start = 0
        for cut in cuts + [len(data)]:
            with open(path, "ab") as f:
                f.write(data[start:cut])
            start = cut
            outcome = read(log)
            if isinstance(outcome, int):  # damage so far: nothing past it was applied
                assert outcome <= cut and log.offset == outcome
        assert outcome == expected
    finally:
        os.unlink(path)


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(logs(), st.integers(1, 4096))
def test_reading_allocates_in_proportion_to_the_file_not_to_length_fields(folder, data, chunk):
    path = new_file(folder, data)
    log = reader(path, chunk)
    try:
        tracemalloc.start()
        try:
            read(log)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # a read's buffer, the bytes parsed and the cache (a few copies of the file at most)
        assert peak < 4 * chunk + 16 * len(data) + 64 * 1024, (peak, len(data))
    finally:
        os.unlink(path)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.text(max_size=6), st.binary(max_size=20)),
        st.tuples(st.just("delete"), st.text(max_size=6), st.just(b"")),
        st.tuples(st.just("refcount"), st.just(""), st.integers(0, 9).map(lambda n: b"%d" % n)),
    ),
    max_size=25,
)


@FUZZ
@given(operations, st.integers(1, 64))
def test_valid_logs_round_trip(folder, ops, chunk):
    items = []
    expected = {}
    for op, key, value in ops:
        if op == "set":
            items.append((file_log.user_key(key), value))
            expected[file_log.user_key(key)] = value
        elif op == "delete":
            items.append((file_log.tombstone_key(file_log.user_key(key)), b""))
            expected.pop(file_log.user_key(key), None)
        else:
            items.append((file_log.REFCOUNT_KEY, value))
            expected[file_log.REFCOUNT_KEY] = value
    data = file_log.encode_records(items)
    assert [(k, v) for _, k, v in file_log.iter_records(data)] == items
    assert file_log.parse(data) == expected
    path = new_file(folder, data)
    try:
        log = reader(path, chunk)
        assert read(log) == expected
        assert log.offset == len(data)
        # a record appended later is read on from where the reader stopped
        with open(path, "ab") as f:
            f.write(file_log.encode_record(b"/late", b"x"))
        assert read(log) == {**expected, b"/late": b"x"}
    finally:
        os.unlink(path)
