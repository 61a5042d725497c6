"""The store server's state directory (journal.py, journaled_state.py, sessions.py): every
change replayed after a restart, a torn last record dropped and a damaged one refused, one
server per directory, compaction keeping DIR bounded and surviving a crash at each step, and
a sequenced write re-sent after a restart answered without being applied twice."""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time

import pytest

from distlib.store.tcp import codec
from distlib.store.tcp import journal_records as records
from distlib.store.tcp import sequence
from distlib.store.tcp.incarnation import INCARNATION_KEY
from distlib.store.tcp.journal import JOURNAL_MAGIC, Journal, JournalError, journal_name, snapshot_name
from distlib.store.tcp.security import StoreSecurity
from distlib.store.tcp.server import StoreServer

pytestmark = pytest.mark.timeout(60)

OPEN = StoreSecurity()
SESSION = bytes(range(16))


def serve(state_dir, **kwargs) -> StoreServer:
    return StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(state_dir), **kwargs).start()


class Raw:
    """A plain socket speaking the wire protocol (no client library: exact bytes)."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(b"\x00" + struct.pack("<I", codec.MAGIC))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            assert chunk, f"server closed the connection after {len(out)} of {n} reply bytes"
            out += chunk
        return out

    def i64(self) -> int:
        return struct.unpack("<q", self.read(8))[0]

    def blob(self) -> bytes:
        return self.read(struct.unpack("<Q", self.read(8))[0])

    def get(self, key: bytes) -> bytes:
        self.send(codec.get(key))
        return self.blob()

    def close(self) -> None:
        self.sock.close()


def writes(raw: Raw) -> None:
    """One of every change the protocol has."""
    raw.send(codec.set_(b"s", b"v1") + codec.set_(b"s", b"v2"))
    raw.send(codec.add(b"n", 5))
    assert raw.i64() == 5
    raw.send(codec.add(b"n", -2))
    assert raw.i64() == 3
    raw.send(codec.append(b"a", b"x") + codec.append(b"a", b"yz"))
    raw.send(codec.compare_set(b"c", b"", b"new"))
    assert raw.blob() == b"new"
    raw.send(codec.compare_set(b"c", b"wrong", b"other"))
    assert raw.blob() == b"new"
    raw.send(codec.multi_set([b"m1", b"m2", b"m3"], [b"1", b"2", b"3"]))
    raw.send(codec.delete_key(b"m2"))
    assert raw.i64() == 1
    raw.send(codec.queue_push(b"q", b"first") + codec.queue_push(b"q", b"second") + codec.queue_pop(b"q"))
    assert raw.i64() == 2 and raw.blob() == b"first"
    raw.send(codec.barrier(b"b", 1))
    assert raw.read(1) == b"\x00"


EXPECTED = {b"s": b"v2", b"n": b"3", b"a": b"xyz", b"c": b"new", b"m1": b"1", b"m3": b"3", b"b": b"1"}


def state_of(server: StoreServer):
    return dict(server.state.data), {k: list(q) for k, q in server.state.queues.items()}


def test_every_change_is_replayed_after_a_restart(tmp_path, caplog):
    server = serve(tmp_path)
    raw = Raw(server.port)
    writes(raw)
    assert raw.get(b"s") == b"v2"  # (a round trip: every write before it has run)
    raw.close()
    server.stop()
    with caplog.at_level(logging.INFO, "distlib.store.tcp.journal"):
        again = StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path))
    try:
        data, queues = state_of(again)
        assert data == EXPECTED, f"replayed keys differ: {data} != {EXPECTED}"
        assert queues == {b"q": [b"second"]}
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("replayed")]
        assert len(lines) == 1 and lines[0].startswith(f"replayed {len(EXPECTED)} keys (") \
            and f"from {tmp_path}" in lines[0], lines
    finally:
        again.close()


def test_the_port_opens_only_after_the_replay(tmp_path, monkeypatch):
    """A TCP readiness probe passes only once the state is back: nothing listens while the
    journal is read."""
    from distlib.store.tcp import server as server_module

    seen = []
    real = Journal.recover

    def recover(self):
        seen.append(server_module.bind_listener)  # (the listener is bound after this returns)
        return real(self)

    bound = []
    real_bind = server_module.bind_listener
    monkeypatch.setattr(Journal, "recover", recover)
    monkeypatch.setattr(server_module, "bind_listener", lambda *a: bound.append(len(seen)) or real_bind(*a))
    StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path)).close()
    assert bound == [1], "the listening socket was bound before the journal was replayed"


def test_a_second_server_on_the_same_directory_is_refused(tmp_path):
    first = StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path))
    try:
        with pytest.raises(JournalError, match=f"in use by another distlib store-server \\(pid {os.getpid()} "):
            StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path))
    finally:
        first.close()
    StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path)).close()  # released: usable again


def test_a_server_waits_for_the_lock_of_one_on_its_way_out(tmp_path, caplog):
    """A replacement started while the old server is stopping (a deleted pod's successor) waits
    for its lock instead of failing, and says so once."""
    first = StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path))
    stopper = threading.Timer(0.5, first.close)
    stopper.start()
    try:
        with caplog.at_level(logging.WARNING, "distlib.store.tcp.journal"):
            started = time.monotonic()
            second = StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path), lock_wait=10)
            waited = time.monotonic() - started
        second.close()
    finally:
        stopper.join()
    said = [r.getMessage() for r in caplog.records if "locked by another" in r.getMessage()]
    assert len(said) == 1 and f"pid {os.getpid()}" in said[0], said
    assert waited < 10, f"the second server waited {waited:.1f} s, past its lock wait, though the first stopped"


def test_a_lock_held_past_the_wait_refuses_the_start_saying_how_long_it_waited(tmp_path):
    first = StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path))
    try:
        with pytest.raises(JournalError, match=r"\(pid \d+ holds .*lock\) after waiting 300ms"):
            StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path), lock_wait=0.3)
    finally:
        first.close()


def journal_file(tmp_path) -> str:
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("journal-"))
    assert names, f"no journal in {tmp_path}: {os.listdir(tmp_path)}"
    return os.path.join(tmp_path, names[-1])


def two_sets(tmp_path):
    server = serve(tmp_path)
    raw = Raw(server.port)
    raw.send(codec.set_(b"k1", b"one") + codec.set_(b"k2", b"two"))
    assert raw.get(b"k2") == b"two"
    raw.close()
    server.stop()
    return journal_file(tmp_path)


@pytest.mark.parametrize("cut", [1, 5, 9, 20])
def test_a_torn_last_record_is_dropped_and_said(tmp_path, caplog, cut):
    path = two_sets(tmp_path)
    size = os.path.getsize(path)
    os.truncate(path, size - cut)  # the crash cut the last write short
    second = len(records.frame(records.set_record(b"k2", b"two")))
    with caplog.at_level(logging.WARNING, "distlib.store.tcp.journal"):
        server = StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path))
    try:
        assert state_of(server)[0] == {b"k1": b"one"}
        warned = [r.getMessage() for r in caplog.records if "torn last record" in r.getMessage()]
        assert warned == [f"journal {path}: dropped a torn last record (a write cut short by a crash) at offset "
                          f"{size - second} ({second - cut} bytes); the records before it are kept"], warned
        assert os.path.getsize(path) == size - second, "the file was not truncated at the torn record"
    finally:
        server.close()


def test_a_bad_checksum_on_the_last_record_is_a_torn_write(tmp_path):
    path = two_sets(tmp_path)
    with open(path, "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 0xFF]))
    server = StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path))
    try:
        assert state_of(server)[0] == {b"k1": b"one"}
    finally:
        server.close()


def test_a_damaged_record_in_the_middle_refuses_to_start(tmp_path):
    path = two_sets(tmp_path)
    offset = len(JOURNAL_MAGIC) + records.FRAME.size + 2  # inside the first record
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(JournalError, match=f"{path}: damaged record at offset {len(JOURNAL_MAGIC)} of "):
        StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path))
    os.truncate(path, len(JOURNAL_MAGIC))
    StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path)).close()


def test_compaction_bounds_the_directory_and_keeps_every_key(tmp_path):
    server = serve(tmp_path, compact_bytes=64 << 10)
    raw = Raw(server.port)
    value = b"x" * 100
    for round_ in range(40):  # the same 50 keys rewritten: the live state stays ~6 KiB
        raw.send(b"".join(codec.set_(b"key%d" % i, value + b"%d" % round_) for i in range(50)))
        raw.send(codec.add(b"count", 1))
        assert raw.i64() == round_ + 1
    assert server.journal.wait_compaction(30)
    assert server.journal.compactions >= 1
    files = os.listdir(tmp_path)
    total = sum(os.path.getsize(os.path.join(tmp_path, n)) for n in files)
    assert total < 3 * (64 << 10), f"state directory holds {total} bytes in {files}"
    raw.close()
    server.stop()
    again = StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path))
    try:
        data = state_of(again)[0]
        assert data[b"count"] == b"40"
        wrong = [i for i in range(50) if data.get(b"key%d" % i) != value + b"39"]
        assert not wrong, f"keys {wrong} lost their last value in the compaction"
    finally:
        again.close()


@pytest.mark.parametrize("step", ["tmp-written", "renamed", "covered-deleted"])
def test_a_crash_at_any_step_of_compaction_recovers(tmp_path, step):
    """The directory as a crash would leave it at each step of a compaction: the journal
    rotated, then a snapshot being written, renamed, and the covered journal deleted."""
    journal = Journal(str(tmp_path))
    journal.recover()
    journal.pending.append(records.frame(records.set_record(b"a", b"1")))
    journal.commit()
    first = os.path.join(tmp_path, journal_name(1))
    with open(first, "rb") as fh:
        covered = fh.read()
    image = records.Image()
    image.data = {b"a": b"1"}
    journal.copy_state = lambda: image
    journal.compact()  # journal 2 from now on; snapshot 1 written, journal 1 deleted
    assert journal.wait_compaction(30)
    journal.pending.append(records.frame(records.set_record(b"b", b"2")))
    journal.commit()
    journal.close()
    snap = os.path.join(tmp_path, snapshot_name(1))
    assert sorted(os.listdir(tmp_path)) == ["incarnation", journal_name(2), "lock", snapshot_name(1)]
    if step != "covered-deleted":  # the crash came before the covered journal was deleted ...
        with open(first, "wb") as fh:
            fh.write(covered)
    if step == "tmp-written":  # ... or before the snapshot was renamed into place
        os.rename(snap, snap + ".tmp")
    server = StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path))
    try:
        assert state_of(server)[0] == {b"a": b"1", b"b": b"2"}
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
        if step != "tmp-written":
            assert journal_name(1) not in os.listdir(tmp_path), "a journal the snapshot covers was kept"
    finally:
        server.close()


def test_the_sequence_header_is_a_set_of_the_reserved_key():
    assert sequence.sequence_header(SESSION, 7) == codec.set_(codec.SEQUENCE_KEY, SESSION + struct.pack("<Q", 7))
    assert codec.decode(sequence.sequence_header(SESSION, 7), 0, sequence.SEQUENCE_HEADER_BYTES, codec.Limits())[1] == \
        (codec.SEQUENCE_KEY, SESSION + struct.pack("<Q", 7))


def sequenced(seq: int, request: bytes, session: bytes = SESSION) -> bytes:
    return sequence.sequence_header(session, seq) + request


ADD_S, CAS_S, APPEND_S = b"A" * 16, b"C" * 16, b"P" * 16


@pytest.mark.parametrize("sync", ["turn", "none"])
def test_a_sequenced_write_resent_after_a_restart_is_not_applied_twice(tmp_path, sync):
    """Three clients' last writes (an ADD, a COMPARE_SET, an APPEND) were applied, then the
    master restarted before they saw the replies: re-sent, each gets the reply it had, once."""
    server = serve(tmp_path, sync=sync)
    raw = Raw(server.port)
    raw.send(sequenced(1, codec.add(b"n", 7), ADD_S) + sequenced(2, codec.add(b"n", 1), ADD_S))
    assert raw.i64() == 7 and raw.i64() == 8
    raw.send(sequenced(1, codec.compare_set(b"c", b"", b"mine"), CAS_S))
    assert raw.blob() == b"mine"
    raw.send(sequenced(9, codec.append(b"a", b"tail"), APPEND_S))
    raw.send(codec.compare_set(b"c", b"mine", b"theirs"))  # another client changed it since
    assert raw.blob() == b"theirs"
    raw.close()
    server.stop()
    server = serve(tmp_path, sync=sync)
    try:
        raw = Raw(server.port)
        raw.send(sequenced(2, codec.add(b"n", 1), ADD_S))
        assert raw.i64() == 8, "a re-sent ADD got another reply than the first time"
        raw.send(sequenced(1, codec.compare_set(b"c", b"", b"mine"), CAS_S))
        assert raw.blob() == b"mine", "a re-sent COMPARE_SET got another reply than the first time"
        raw.send(sequenced(9, codec.append(b"a", b"tail"), APPEND_S))
        for key, value in ((b"n", b"8"), (b"c", b"theirs"), (b"a", b"tail")):
            assert raw.get(key) == value, f"a re-sent write to {key!r} was applied twice"
        raw.send(sequenced(3, codec.add(b"n", 1), ADD_S))  # the next one is applied
        assert raw.i64() == 9
        raw.send(sequenced(1, codec.add(b"n", 1), ADD_S))  # an older one is a client's bug
        assert raw.sock.recv(1) == b"", "a sequence number that went back was accepted"
        raw.close()
    finally:
        server.stop()


def test_a_sequence_header_split_across_reads_and_behind_a_wait(tmp_path):
    server = serve(tmp_path)
    try:
        raw = Raw(server.port)
        request = sequenced(1, codec.add(b"n", 2))
        for i in range(len(request)):  # one byte at a time: the two run as one request
            raw.send(request[i:i + 1])
            time.sleep(0.001)
        assert raw.i64() == 2
        # behind a pending WAIT (ordered waits): held, and run whole once the wait completes
        raw.send(codec.wait([b"later"]) + sequenced(2, codec.add(b"n", 3)) + sequenced(2, codec.add(b"n", 3)))
        other = Raw(server.port)
        other.send(codec.set_(b"later", b"1"))
        assert raw.read(1) == b"\x00"
        assert raw.i64() == 5 and raw.i64() == 5, "a repeated sequence number was applied again"
        other.close()
        raw.close()
    finally:
        server.stop()


def test_a_sequence_header_before_a_read_closes_the_connection(tmp_path):
    server = serve(tmp_path)
    try:
        raw = Raw(server.port)
        raw.send(sequenced(1, codec.get(b"x")))
        assert raw.sock.recv(1) == b"", "the server answered a sequence header before a GET"
    finally:
        server.stop()


def test_a_journal_that_cannot_be_written_stops_the_server_without_a_reply(tmp_path):
    """Disk full or an I/O error: no reply for a change that is not on disk; the server stops
    (exit 1 as a service) and its clients see the connection close, as in a crash."""
    server = serve(tmp_path)
    raw = Raw(server.port)
    raw.send(codec.set_(b"k", b"v"))
    assert raw.get(b"k") == b"v"

    def full():
        raise OSError(28, "No space left on device")

    server.journal.commit = full
    raw.send(codec.add(b"n", 1))
    assert raw.sock.recv(8) == b"", "a change that could not be journaled was answered"
    server.stop()
    assert server.failed == "journal write failed: No space left on device"


def incarnation_of(port: int) -> bytes:
    raw = Raw(port)
    try:
        return raw.get(INCARNATION_KEY)
    finally:
        raw.sock.close()


def test_the_incarnation_lives_as_long_as_the_directory_s_state(tmp_path):
    """A GET of the reserved key answers the state's 16 bytes without storing a key: the same
    after a restart on the same directory, a new one on a wiped directory and on every start
    without a directory (what a reconnecting client compares: client.py)."""
    server = serve(tmp_path / "state")
    first = incarnation_of(server.port)
    raw = Raw(server.port)
    raw.send(codec.getnumkeys())
    assert raw.i64() == 0, "asking the incarnation stored a key"
    raw.sock.close()
    server.stop()
    assert len(first) == 16
    server = serve(tmp_path / "state")
    assert incarnation_of(server.port) == first, "a restart on the same state directory changed the incarnation"
    server.stop()
    for name in os.listdir(tmp_path / "state"):
        os.unlink(tmp_path / "state" / name)
    server = serve(tmp_path / "state")
    wiped = incarnation_of(server.port)
    server.stop()
    assert wiped != first and len(wiped) == 16, "a wiped state directory kept the old incarnation"
    plain = [StoreServer("127.0.0.1", 0, security=OPEN).start() for _ in range(2)]
    seen = [incarnation_of(s.port) for s in plain]
    for s in plain:
        s.stop()
    assert seen[0] != seen[1] and all(len(x) == 16 for x in seen), seen


def test_a_directory_from_before_incarnations_gets_one_and_keeps_it(tmp_path):
    server = serve(tmp_path)
    raw = Raw(server.port)
    raw.send(codec.set_(b"/k", b"v") + codec.getnumkeys())
    assert raw.i64() == 1  # (the SET ran: the reply after it came)
    raw.sock.close()
    server.stop()
    os.unlink(tmp_path / "incarnation")  # as a directory written before this file existed
    server = serve(tmp_path)
    given = incarnation_of(server.port)
    assert Raw(server.port).get(b"/k") == b"v"
    server.stop()
    server = serve(tmp_path)
    assert incarnation_of(server.port) == given
    server.stop()
