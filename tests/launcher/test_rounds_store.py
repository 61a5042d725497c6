"""The elastic agents' store access (distlib/launcher/rounds_store.py) against a real
`distlib store-server`: what a foreign write to the job's keys does — and does not — do."""

from __future__ import annotations

import logging

import pytest

from distlib.launcher import rounds as R
from distlib.launcher.bookkeeping import Liveness
from distlib.launcher.rounds_store import Heartbeat, RoundStore, peek
from distlib.launcher.state_record import encode
from distlib.store.tcp.client import TCPStore

pytestmark = pytest.mark.timeout(60)


def foreign_write(raw: TCPStore, key: str, value: bytes) -> None:
    """``set`` on another connection than the agent's, applied before this returns (a SET has no
    reply: the get after it on the same connection is what orders it)."""
    raw.set(key, value)
    assert raw.get(key) == value


@pytest.fixture
def stores(store_server):
    """(a RoundStore of run "job" with a 2 s patience, a plain client of the same server)."""
    def connect(seconds: float) -> TCPStore:
        return TCPStore("127.0.0.1", store_server, None, False, seconds)

    rounds = RoundStore(connect, "job", 2.0, 10.0)
    raw = connect(10.0)
    yield rounds, raw
    rounds.close()
    raw.close()


def test_a_foreign_heartbeat_value_breaks_no_other_nodes_heartbeat(stores, caplog):
    """b"not-a-number" in node b's heartbeat key: a and c are read as before, on the same
    connection; b's value is no beat, said once with the key; b's next beat replaces it.
    (Read with add(key, 0), the server refused the ADD and dropped the connection every
    node's reads went through: after the store's patience, every agent failed.)"""
    rounds, raw = stores
    for node in "abc":
        rounds.beat(node, 1)
    foreign_write(raw, rounds.keys.heartbeat("b"), b"not-a-number")
    with caplog.at_level(logging.WARNING, logger="distlib.launcher"):
        assert rounds.beats("abc") == {"a": 1, "b": None, "c": 1}
        rounds.beat("a", 2)
        assert rounds.beats("abc") == {"a": 2, "b": None, "c": 1}
    said = [r.getMessage() for r in caplog.records if "no counter" in r.getMessage()]
    assert said == ["the heartbeat key distlib/elastic/job/hb/b holds 'not-a-number', which is no counter (something "
                    "else wrote it): not counted as a beat; the node's next beat replaces it"], said
    rounds.beat("b", 2)
    assert rounds.beats("abc") == {"a": 2, "b": 2, "c": 1}


def test_a_node_whose_heartbeat_key_stays_foreign_goes_silent():
    """No beat is read from a value that is no counter: the node's silence counts from when it
    was first watched, so a node that really stopped is still found lost."""
    live = Liveness()
    live.observe({"a": 1, "b": None}, now=0.0)
    live.observe({"a": 2, "b": None}, now=5.0)
    live.observe({"a": 3, "b": None}, now=11.0)
    assert live.silent(11.0) == {"a": 0.0, "b": 11.0}
    live.observe({"a": 3, "b": 7}, now=12.0)
    assert live.silent(12.0)["b"] == 0.0


def test_a_node_is_heard_only_once_its_counter_moves_between_two_readings_after_the_time():
    """The first sight of a counter says nothing of whether the node still beats, nor does a move
    seen in the first reading after the round opened (t=2.0): that beat may be from before it,
    from a node killed a moment before (the Compose cluster's FileStore run: its survivors
    rejoined 50 ms after the kill)."""
    live = Liveness()
    live.observe({"a": 4, "b": 9}, now=1.0)
    assert live.heard_since(0.0) == frozenset()
    live.observe({"a": 5, "b": 10}, now=2.5)  # both moved between 1.0 and 2.5: maybe before 2.0
    assert live.heard_since(0.0) == frozenset("ab") and live.heard_since(2.0) == frozenset()
    live.observe({"a": 6, "b": 10}, now=3.0)  # a moved between 2.5 and 3.0: after 2.0
    assert live.heard_since(2.0) == frozenset("a")


def test_the_heartbeat_thread_replaces_a_foreign_value(stores):
    rounds, raw = stores
    heart = Heartbeat(rounds, "a", 60.0).start()
    try:
        foreign_write(raw, rounds.keys.heartbeat("a"), b"\x1b[2Jgarbage")
        heart.retarget("a")  # the next beat, now
        assert raw.get(rounds.keys.heartbeat("a")) == b"2"
    finally:
        heart.stop()


def test_a_bad_state_record_is_read_as_such_naming_the_key(stores):
    rounds, raw = stores
    foreign_write(raw, rounds.keys.elastic_state(),
                  encode(R.initial(2, 3, 3)).replace(b'"round":0', b'"round":"zero"'))
    got, state = rounds.read()
    assert isinstance(state, R.BadRecord) and got.startswith(b"{")
    assert state.key == "distlib/elastic/job/state"
    assert state.problem == "field 'round' is \"zero\": expected an integer of at least 0"


def test_reading_creates_nothing_and_waits_for_nothing(stores):
    rounds, raw = stores
    assert rounds.read() == (b"", None)
    assert rounds.beats(["x"]) == {"x": 0}
    assert peek(raw, "distlib/elastic/job/state") is None
    assert raw.num_keys() == 0, raw.list_keys()
