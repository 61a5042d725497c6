"""The store's absences as an elastic agent sees them (distlib/launcher/outages.py), the retries
of its store calls (rounds_store.RoundStore) and its clocks across an absence
(bookkeeping.Bookkeeping.store_was_away), without processes: a store that fails on demand."""

from __future__ import annotations

import time
from typing import List

import pytest

from distlib.errors import DistNetworkError
from distlib.launcher import rounds as R
from distlib.launcher.bookkeeping import Bookkeeping
from distlib.launcher.elastic_config import ElasticPlan, RdzvConf
from distlib.launcher.outages import StoreOutages
from distlib.launcher.rounds_store import RoundStore, StoreGone
from distlib.store.hash import HashStore

pytestmark = pytest.mark.timeout(60)


class Flaky(HashStore):
    """A store whose next ``failures`` calls fail as a dropped connection does."""

    failures = 0

    def compare_set(self, key, expected_value, desired_value):
        if Flaky.failures:
            Flaky.failures -= 1
            raise DistNetworkError("Connection reset by peer (TCPStore server master:29500, during COMPARE_SET)")
        return super().compare_set(key, expected_value, desired_value)

    def describe(self) -> str:
        return "TCPStore server master:29500"


@pytest.fixture
def said() -> List[str]:
    return []


def rounds_of(store: HashStore, said: List[str], patience: float, slow: float = 60.0) -> RoundStore:
    rounds = RoundStore(lambda _s: store, "job", patience, 1.0)
    rounds.outages = StoreOutages(rounds.where, patience, slow, said.append)
    return rounds


def test_a_store_that_comes_back_within_the_bound_is_one_absence_said_twice(said):
    store = Flaky()
    rounds = rounds_of(store, said, patience=10.0)
    Flaky.failures = 3  # three tries, 0.5 s apart, then an answer
    started = time.monotonic()
    assert rounds.read() == (b"", None)
    took = time.monotonic() - started
    (absence,) = rounds.outages.take_ended()
    assert 1.0 <= absence.seconds <= took, (absence, took)
    assert abs(absence.started - (time.time() - took)) < 1.0
    assert len(said) == 2, said
    assert said[0].startswith("the rendezvous store (TCPStore server master:29500) did not answer (reading the job's "
                              "state: Connection reset by peer") and said[0].endswith(
        "the workers keep running; retrying for up to 10.0s (--store-outage-timeout)"), said[0]
    assert said[1].startswith("the rendezvous store (TCPStore server master:29500) answers again after "), said[1]
    assert rounds.outages.take_ended() == [] and rounds.outages.away() == 0.0


def test_past_the_bound_the_call_fails_naming_the_store_and_how_long(said):
    store = Flaky()
    rounds = rounds_of(store, said, patience=1.2)
    Flaky.failures = 1000
    started = time.monotonic()
    with pytest.raises(StoreGone) as caught:
        rounds.read()
    assert time.monotonic() - started < 1.2 + 1.0
    assert str(caught.value).startswith("the rendezvous store (TCPStore server master:29500) did not answer for ")
    assert "(reading the job's state; --store-outage-timeout 1.2s): Connection reset by peer" in str(caught.value)
    Flaky.failures = 0


def test_a_signal_stops_the_wait_for_the_store(said):
    store = Flaky()
    rounds = RoundStore(lambda _s: store, "job", 30.0, 1.0, interrupted=lambda: True)
    Flaky.failures = 1000
    with pytest.raises(StoreGone, match="stopped waiting for it after .*: this node received a signal"):
        rounds.read()
    Flaky.failures = 0


def test_a_call_that_answers_late_met_a_store_that_was_away(said):
    """A frozen master does not refuse: it answers late. Slower than ``slow``, the call's time is
    an absence; faster, nothing."""
    outages = StoreOutages("TCPStore server master:29500", 60.0, 1.0, said.append)
    outages.answered(time.monotonic() - 0.5, "a heartbeat")
    assert outages.take_ended() == [] and said == []
    outages.answered(time.monotonic() - 7.0, "a heartbeat")
    (absence,) = outages.take_ended()
    assert absence.seconds == pytest.approx(7.0, abs=0.5)
    assert said == [f"the rendezvous store (TCPStore server master:29500) took {said[0].split('took ')[1].split()[0]} "
                    "to answer (a heartbeat): the job goes on where it was, no restart"]


def test_both_clients_of_an_agent_make_one_absence(said):
    """The heartbeat thread's call fails first, the loop's a moment later; the loop's answers
    first: one absence, from the first failure to the first answer."""
    outages = StoreOutages("TCPStore server master:29500", 60.0, 60.0, said.append)
    now = time.monotonic()
    outages.failed(now - 3.0, "a heartbeat", OSError("refused"))
    outages.failed(now - 2.0, "reading the job's state", OSError("refused"))
    outages.answered(now - 0.1, "reading the job's state")
    outages.answered(now - 0.1, "a heartbeat")
    (absence,) = outages.take_ended()
    assert absence.seconds == pytest.approx(3.0, abs=0.5) and len(said) == 2, said


def plan() -> ElasticPlan:
    return ElasticPlan(2, 3, 3, 0.1, RdzvConf(keep_alive_interval=1.0, keep_alive_max_attempt=4,
                                              last_call_timeout=4.0))


def state_of(phase_running: bool) -> R.JobState:
    info = {n: R.NodeInfo(f"host-{n}", f"10.0.0.{i}", 100 + i, 1) for i, n in enumerate("abc")}
    state = R.initial(2, 3, 3)
    for n in "abc":
        state = R.join(state, n, info[n])
    return R.close(state) if phase_running else state


def test_nobody_is_lost_for_the_time_the_store_was_away():
    """Every node's counter stood still for 30 s because the store did not answer: once it does,
    silence counts from then, and decide drops nobody (bound 4 s); a node that stays silent
    after is lost as before."""
    books = Bookkeeping(plan())
    state = state_of(True)
    books.observe(state, "a", 0.0)
    books.observe_beats({"a": 1, "b": 1, "c": 1}, "abc", 0.0)
    books.store_was_away(30.0, now=31.0)
    view = books.view(31.5, 0)
    assert max(view.silent.values()) == pytest.approx(0.5), view.silent
    assert R.decide(state, "a", state.nodes["a"], view).kind is R.Kind.KEEP
    books.observe_beats({"a": 2, "b": 2, "c": 1}, "abc", 33.0)
    action = R.decide(state, "a", state.nodes["a"], books.view(35.2, 0))
    assert action.kind is R.Kind.WRITE and action.text.startswith("node lost: host-c"), action


def test_the_last_call_does_not_run_out_while_the_store_is_away():
    """MIN joined at t=1, the last call is 4 s; the store was away for 10 s from t=2: when it
    answers (t=12) the round is still open for the third node, for the 3 s the last call had left."""
    books = Bookkeeping(plan())
    state = R.initial(2, 3, 3)
    info = {n: R.NodeInfo(f"host-{n}", "10.0.0.1", 1, 1) for n in "ab"}
    state = R.join(R.join(state, "a", info["a"]), "b", info["b"])
    books.observe(state, "a", 1.0)
    books.store_was_away(10.0, now=12.0)
    assert R.decide(state, "a", info["a"], books.view(12.5, None)).kind is R.Kind.WAIT
    action = R.decide(state, "a", info["a"], books.view(15.1, None))
    assert action.kind is R.Kind.WRITE and action.state.phase == R.RUNNING, action
