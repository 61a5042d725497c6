"""The session table's bounds (sessions.py): a session is forgotten after its idle time, the
least recently used go first past the count and reply-bytes caps, and every forgotten session
is reported for the journal. A clock the test moves stands for time."""

from __future__ import annotations

from distlib.store.tcp.journal_records import forget_record
from distlib.store.tcp.sessions import Sessions


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def sid(n: int) -> bytes:
    return n.to_bytes(16, "little")


def test_a_session_idle_past_its_time_is_forgotten_and_reported():
    clock = Clock()
    sessions = Sessions(clock=clock, idle_s=100.0)
    sessions.journaled = True
    sessions.record(sid(1), 1, b"r1")
    clock.now += 60
    sessions.record(sid(2), 1, b"r2")
    clock.now += 50  # session 1 idle 110 s, session 2 50 s
    records = sessions.record(sid(3), 1, b"r3")
    assert sessions.get(sid(1)) is None, "session 1 was kept 110 s after its last write (idle time 100 s)"
    assert sessions.get(sid(2)) is not None and sessions.get(sid(3)) is not None
    assert records is not None and forget_record(sid(1)) in records
    assert sessions.reply_bytes == 4


def test_a_session_s_own_writes_keep_it_alive():
    """The first session of an empty table, written to again and again, is never idle; a
    session recorded after the table emptied idles out from its own last write."""
    clock = Clock()
    sessions = Sessions(clock=clock, idle_s=100.0)
    for seq in range(1, 6):
        sessions.record(sid(1), seq, b"r")
        clock.now += 60
    assert sessions.get(sid(1)).seq == 5
    clock.now += 200
    sessions.record(sid(2), 1, b"r")  # session 1 idle 260 s: forgotten; the table then holds 2
    assert sessions.get(sid(1)) is None and len(sessions) == 1
    clock.now += 150
    sessions.record(sid(3), 1, b"r")
    assert sessions.get(sid(2)) is None, "session 2 outlived its idle time (recorded after the table had emptied)"


def test_past_the_caps_the_least_recently_used_go_first():
    clock = Clock()
    sessions = Sessions(clock=clock, max_sessions=3, max_reply_bytes=10)
    for n in (1, 2, 3):
        sessions.record(sid(n), 1, b"x")
    sessions.record(sid(1), 2, b"x")  # 1 is now the most recently used
    sessions.record(sid(4), 1, b"x")
    assert [s for s in (1, 2, 3, 4) if sessions.get(sid(s)) is not None] == [1, 3, 4], "not the LRU session went"
    sessions.record(sid(5), 1, b"y" * 8)  # 1 + 1 + 1 + 8 bytes > 10: the oldest (3) goes, and it fits
    kept = [s for s in (1, 3, 4, 5) if sessions.get(sid(s)) is not None]
    assert kept == [1, 4, 5] and sessions.reply_bytes == 10, (kept, sessions.reply_bytes)


def test_a_repeated_write_replaces_the_entry_and_the_old_one_is_left_as_it_was():
    """A snapshot's copy of the table shares its entries: record() must not change them."""
    sessions = Sessions(clock=Clock())
    sessions.record(sid(1), 1, b"first")
    before = sessions.get(sid(1))
    sessions.record(sid(1), 2, b"second")
    assert (before.seq, before.reply) == (1, b"first"), "the entry a snapshot may be writing was changed"
    assert sessions.get(sid(1)).seq == 2 and sessions.reply_bytes == len(b"second")
