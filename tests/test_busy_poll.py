"""distlib/busy_poll.py: the one busy-poll policy of the store server, its clients and the mesh."""

import time

import pytest

from distlib import busy_poll
from distlib.busy_poll import MAX_BACKOFF_LEVEL, BusyPoll


def never():
    """A probe whose peer never answers (a non-blocking recv with nothing to read)."""
    raise BlockingIOError


@pytest.fixture
def two_cpus(monkeypatch):
    """As on a 2-CPU machine with an idle run queue, whatever this one has."""
    monkeypatch.setattr(busy_poll, "usable_cpus", lambda: 2)
    monkeypatch.setattr(busy_poll, "runnable_tasks", lambda: 1)


def allowed(busy: BusyPoll) -> bool:
    """Whether ``busy`` spins now: its probe is called (and answers at once, a hit)."""
    return busy.spin(lambda: True, count_miss=False) is not None


def test_busy_poll_follows_the_runnable_count_of_each_moment(two_cpus, monkeypatch):
    """Spinning stops on the very next decision once more tasks are runnable than this
    process has CPUs, and resumes as soon as they are not: a stale "not crowded" would let
    the server spin on a CPU that the ranks' processes are waiting for."""
    busy = BusyPoll(200e-6)
    runnable = iter([1, 2, 3, 5, 2, None])
    monkeypatch.setattr(busy_poll, "runnable_tasks", lambda: next(runnable))
    assert [allowed(busy) for _ in range(6)] == [True, True, False, False, True, True]


def test_a_crowded_machine_gets_no_spin_at_all(two_cpus, monkeypatch):
    monkeypatch.setattr(busy_poll, "runnable_tasks", lambda: 3)
    calls = []
    assert BusyPoll(200e-6).spin(lambda: calls.append(1)) is None
    assert calls == []  # the caller blocks at once


def test_busy_poll_off_never_reads_the_load(monkeypatch):
    def fail():
        raise AssertionError("the load was read although spinning is off")

    monkeypatch.setattr(busy_poll, "runnable_tasks", fail)
    assert allowed(BusyPoll(0.0)) is False
    assert BusyPoll(0.0, yield_cpu=False).spin(never) is None


def test_one_usable_cpu_means_no_spinning_for_those_who_yield(monkeypatch):
    monkeypatch.setattr(busy_poll, "usable_cpus", lambda: 1)
    monkeypatch.setattr(busy_poll, "runnable_tasks", lambda: 0)
    assert allowed(BusyPoll(200e-6)) is False
    assert allowed(BusyPoll(200e-6, yield_cpu=False)) is True  # the mesh's choice


def test_the_mesh_policy_never_reads_the_load(monkeypatch):
    def fail():
        raise AssertionError("the load was read by a poller that does not yield")

    monkeypatch.setattr(busy_poll, "runnable_tasks", fail)
    assert BusyPoll(80e-6, yield_cpu=False, backoff=True).spin(lambda: [1]) == [1]


def test_spin_returns_the_first_answer_and_ignores_empty_ones(two_cpus):
    answers = iter([[], None, b"", [(3, 1)]])
    busy = BusyPoll(0.5)
    assert busy.spin(lambda: next(answers)) == [(3, 1)]


def test_spin_gives_up_after_its_window(two_cpus):
    busy = BusyPoll(2e-3)
    t0 = time.perf_counter()
    assert busy.spin(never) is None
    assert 2e-3 <= time.perf_counter() - t0 < 0.5


def test_misses_back_off_in_time_and_a_hit_starts_afresh(two_cpus, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(busy_poll.time, "perf_counter", lambda: now[0])

    def late():  # the window passes while the probe waits
        now[0] += 1.0
        raise BlockingIOError

    busy = BusyPoll(1.0, backoff=True)
    assert busy.spin(late) is None
    assert busy.misses == 1 and busy.quiet_until == now[0] + 2.0
    assert not allowed(busy)  # quiet for window x 2
    now[0] += 2.0
    assert busy.spin(late) is None  # spins again (the probe moved the clock), and misses
    assert busy.misses == 2 and busy.quiet_until == now[0] + 4.0
    now[0] += 4.0
    assert busy.spin(lambda: b"reply") == b"reply"
    assert busy.misses == 0 and allowed(busy)


def test_the_back_off_is_capped(two_cpus, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(busy_poll.time, "perf_counter", lambda: now[0])

    def late():
        now[0] += 1.0
        raise BlockingIOError

    busy = BusyPoll(1.0, backoff=True)
    for _ in range(MAX_BACKOFF_LEVEL + 5):
        now[0] = busy.quiet_until
        busy.spin(late)
    assert busy.misses == MAX_BACKOFF_LEVEL
    assert busy.quiet_until - now[0] == 1 << MAX_BACKOFF_LEVEL


def test_misses_that_say_nothing_about_the_peer_do_not_back_off(two_cpus):
    """A WAIT's reply comes when another client acts: missing the window is not the
    server's fault, and the next request must still spin."""
    busy = BusyPoll(1e-4, backoff=True)
    assert busy.spin(never, count_miss=False) is None
    assert busy.misses == 0 and allowed(busy)


def test_a_server_does_not_back_off(two_cpus):
    busy = BusyPoll(1e-4)
    for _ in range(3):
        assert busy.spin(never) is None
    assert busy.misses == 0 and allowed(busy)


def test_the_runnable_count_is_read_from_proc_loadavg():
    count = busy_poll.runnable_tasks()
    assert count is None or count >= 1  # this process is running
