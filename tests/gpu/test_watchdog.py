"""The nccl watchdog's decisions and its error, from sequence records in a real TCPStore."""

import threading
from datetime import timedelta

import pytest

import distlib as dist
from distlib.backends.nccl import watchdog as W
from distlib.backends.nccl.lifecycle import EnqueueFailure, Lifecycle
from tests.fixtures.ports import free_port

HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}


@pytest.fixture
def stores():
    """A TCPStore master and one client connection per rank (what each rank's clone is)."""
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10), wait_for_workers=False)
    clients = [dist.PrefixStore("default_pg/0//cuda/", dist.TCPStore("127.0.0.1", port, 1, False,
                                                                     timedelta(seconds=10))) for _ in range(4)]
    yield master, clients
    for client in clients:
        client.underlying_store.close()
    master.close()


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(W, "HEARTBEAT_S", 0.05)


def test_records_round_trip():
    assert W.Record.decode(W.Record(12, 3).encode()) == W.Record(12, 3)


def test_laggards_and_silent_ranks_from_two_readings():
    first = {0: W.Record(7, 10), 1: W.Record(6, 4), 3: W.Record(7, 8)}
    second = {0: W.Record(7, 11), 1: W.Record(6, 4), 3: W.Record(8, 9)}
    assert W.laggards(7, 4, first, second) == [1, 2]  # 1 stopped at #6; 2 never published
    assert W.laggards(6, 4, first, second) == [2]
    assert W.silent(4, first, second) == [1, 2]
    assert W.laggards(7, 2, {0: W.Record(6, 1)}, {0: W.Record(7, 2)}) == [1]  # reached it between the reads


def test_heartbeats_in_a_real_store_name_the_rank_that_had_not_reached_the_collective(stores, fast):
    """Four ranks publish through their own connections; rank 2 issued #6 only and then died.
    The error for collective #7 names it twice: behind, and silent."""
    _, clients = stores
    issued = [7, 7, 6, 7]
    beats = [W.Heartbeat(clients[r], r, (lambda r=r: issued[r]), f"pg0/nccl{r}").start() for r in range(4)]
    try:
        beats[2].close()  # rank 2 dies: its counter stops
        stop = threading.Event()
        first, second, problem, watched = W.diagnose(clients[0], 4, stop, watch_s=0.3)
        assert problem == "" and watched >= 0.3
        text = W.failure_text("pg0/nccl rank 0", "all_reduce of 4 x float32 on cuda:0", 7, True,
                              "timed out after 10.0s (timeout 10.0s)", 4, first, second, HOSTS, watched)
    finally:
        for beat in beats:
            beat.close()
    assert text.startswith("pg0/nccl rank 0: all_reduce of 4 x float32 on cuda:0 (collective #7 in this group) "
                           "timed out after 10.0s (timeout 10.0s).")
    assert "Ranks that had not reached #7: rank 2 on node-b, last issued #6." in text
    assert "from: rank 2 on node-b, last issued #6 (dead or frozen)" in text
    assert "rank 1" not in text and "rank 3" not in text
    assert text.endswith("destroy_process_group() and init again to go on.")


def _readings(clients, beating, issued, reader=0):
    """Heart-beats from the ``beating`` ranks (each having issued ``issued``), read twice by
    ``reader``'s connection: diagnose's answer."""
    beats = [W.Heartbeat(clients[r], r, lambda: issued, "pg").start() for r in beating]
    try:
        return W.diagnose(clients[reader], 4, threading.Event(), watch_s=0.2)
    finally:
        for beat in beats:
            beat.close()


def test_a_rank_that_never_published_has_no_record(stores, fast):
    first, second, problem, watched = _readings(stores[1], (0, 1, 3), 3, reader=1)
    text = W.failure_text("pg rank 1", "broadcast", 3, True, "failed: NCCL reported X", 4, first, second, HOSTS,
                          watched)
    assert "Ranks that had not reached #3: rank 2 on node-b, no record." in text


def test_nobody_behind_and_nobody_silent(stores, fast):
    first, second, problem, watched = _readings(stores[1], range(4), 5)
    text = W.failure_text("pg rank 0", "all_gather", 5, True, "failed: NCCL reported remote error", 4, first,
                          second, HOSTS, watched)
    assert "Ranks that had not reached #5: none." in text and "heart-beat" not in text


def test_point_to_point_failures_name_silent_ranks_only(stores, fast):
    first, second, problem, watched = _readings(stores[1], (0, 1, 2), 1)
    text = W.failure_text("pg rank 0", "send of 3 x int64", 2, False, "timed out after 1.0s", 4, first, second,
                          HOSTS, watched)
    assert "(point-to-point #2 in this group)" in text and "had not reached" not in text
    assert "from: rank 3 on node-b, no record" in text


def test_a_lost_store_is_said_not_guessed(stores):
    master, clients = stores
    clients[0].set(W.record_key(0), W.Record(1, 1).encode())
    master.close()
    clients[0].underlying_store.close()
    first, second, problem, _ = W.diagnose(clients[0], 2, threading.Event(), watch_s=0.1)
    assert problem
    text = W.failure_text("pg rank 0", "all_reduce", 2, True, "timed out", 2, first, second, HOSTS, 0.0, problem)
    assert "Could not read the ranks' records from the store" in text and "Ranks that had not" not in text


# -- the watchdog's decisions ----------------------------------------------------------------------


class _Op:
    """An outstanding operation whose completion the test controls: its own event (``done``)
    and its Work (``settle``)."""

    def __init__(self, seq, started):
        self.done = False
        self.settled = []
        self.pending = W.Pending(seq, True, "op", None, started, self, object(), self)

    def finish(self):
        self.done = True

    def settle(self, error):
        self.settled.append(error)


class _Comm:
    """The communicator as the watchdog sees it: asynchronous errors the test scripts, aborts counted."""

    def __init__(self, async_errors):
        self.errors, self.aborts = list(async_errors), 0

    def async_error(self):
        return self.errors.pop(0) if self.errors else None

    def abort(self):
        self.aborts += 1


class _Diagnosis:
    """Records each failure the watchdog has described, and describes it in one line."""

    def __init__(self):
        self.failures = []

    def describe(self, oldest, cause, stop):
        self.failures.append((oldest.seq if oldest else None, cause))
        return f"failed at {oldest.seq if oldest else 'idle'}: {cause}"


def _watchdog(async_errors=(), timeout_s=10.0):
    diagnosis = _Diagnosis()
    dog = W.Watchdog("pg0/nccl", timeout_s, Lifecycle("pg0/nccl", 1.0), _Comm(async_errors), diagnosis)
    return dog, diagnosis.failures


def test_finished_operations_are_settled_and_released():
    dog, failures = _watchdog()
    a, b = _Op(1, 100.0), _Op(2, 100.0)
    dog.add(a.pending)
    dog.add(b.pending)
    assert dog.poll_once(now=101.0) is False and a.settled == [] and dog.outstanding() == 2
    a.finish()
    assert dog.poll_once(now=101.0) is False
    assert a.settled == [None] and b.settled == [] and dog.outstanding() == 1
    b.finish()
    dog.poll_once(now=101.0)
    assert b.settled == [None] and dog.outstanding() == 0 and failures == []


def test_the_oldest_operation_past_the_timeout_fails_everything_outstanding():
    dog, failures = _watchdog(timeout_s=10.0)
    a, b = _Op(4, 100.0), _Op(5, 105.0)
    dog.add(a.pending)
    dog.add(b.pending)
    assert dog.poll_once(now=109.9) is False
    assert dog.poll_once(now=110.5) is True
    assert failures == [(4, "timed out after 10.5s (timeout 10.0s)")]
    assert str(a.settled[0]) == str(b.settled[0]) == "failed at 4: timed out after 10.5s (timeout 10.0s)"
    assert dog.lifecycle.failed and dog.handled_failure and dog.outstanding() == 0
    assert dog.comm.aborts == 1 and dog.lifecycle.halted and dog.lifecycle.failing.is_set()
    assert str(dog.lifecycle.error) == "failed at 4: timed out after 10.5s (timeout 10.0s)"


def test_an_nccl_error_fails_at_once_even_when_idle():
    dog, failures = _watchdog(async_errors=["failed: NCCL reported NCCL_ERROR_REMOTE_ERROR"])
    assert dog.poll_once(now=0.0) is True
    assert failures == [(None, "failed: NCCL reported NCCL_ERROR_REMOTE_ERROR")]


def test_what_finished_before_the_error_stays_a_success():
    dog, failures = _watchdog(async_errors=[None, "failed: NCCL reported boom"])
    a, b = _Op(1, 0.0), _Op(2, 0.0)
    dog.add(a.pending)
    dog.add(b.pending)
    dog.poll_once(now=1.0)
    a.finish()
    assert dog.poll_once(now=1.0) is True
    assert a.settled == [None] and str(b.settled[0]) == "failed at 2: failed: NCCL reported boom"


def test_the_thread_polls_and_stops():
    dog, failures = _watchdog()
    op = _Op(1, 0.0)
    op.pending.started = __import__("time").monotonic()
    dog.start()
    dog.add(op.pending)
    op.finish()
    for _ in range(200):
        if op.settled:
            break
        threading.Event().wait(0.01)
    assert op.settled == [None]
    assert dog.close() == [] and not dog.thread.is_alive()


def test_an_error_with_nothing_outstanding_has_no_number():
    records = {0: W.Record(4, 1), 1: W.Record(4, 1)}
    later = {0: W.Record(4, 2), 1: W.Record(4, 2)}
    text = W.failure_text("pg rank 0", "the communicator on cuda:0, idle after collective #4,", None, True,
                          "failed: NCCL reported remote error", 2, records, later, HOSTS, 3.0)
    assert text.startswith("pg rank 0: the communicator on cuda:0, idle after collective #4, failed: NCCL reported")
    assert "in this group" not in text and "had not reached" not in text


def test_only_the_oldest_is_asked_and_finished_ones_settle_in_issue_order():
    """One stream runs its operations in order: a later one reported done before the oldest
    (never on a GPU) waits for it; the watchdog never looks past the oldest."""
    dog, failures = _watchdog()
    a, b = _Op(1, 100.0), _Op(2, 100.0)
    dog.add(a.pending)
    dog.add(b.pending)
    b.finish()
    assert dog.poll_once(now=101.0) is False and a.settled == b.settled == [] and dog.outstanding() == 2
    a.finish()
    dog.poll_once(now=101.0)
    assert a.settled == b.settled == [None] and dog.outstanding() == 0


def test_a_failing_watchdog_fails_the_group_instead_of_dying_silently():
    """An event query that raises (the device is gone) becomes the group's error."""
    dog, failures = _watchdog()

    class Broken:
        @property
        def done(self):
            raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")

    op = _Op(1, __import__("time").monotonic())
    op.pending.event = Broken()
    dog.add(op.pending)
    dog.start()
    dog.thread.join(10)
    assert not dog.thread.is_alive() and dog.lifecycle.failed
    assert failures == [(1, "could not be watched: the watchdog failed (RuntimeError: cudaErrorLaunchFailure: "
                            "unspecified launch failure)")]
    assert str(op.settled[0]).startswith("failed at 1: could not be watched")


def test_flush_waits_for_the_outstanding_and_halt_stops_successes():
    dog, failures = _watchdog()
    a = _Op(1, __import__("time").monotonic())
    dog.add(a.pending)
    dog.start()
    assert dog.flush(0.05) is False  # not finished yet
    a.finish()
    assert dog.flush(10) is True and a.settled == [None]
    b = _Op(2, __import__("time").monotonic())
    dog.halt()
    dog.add(b.pending)
    b.finish()  # an aborted kernel completes its event too
    assert dog.flush(0.2) is False and b.settled == []
    assert [p.seq for p in dog.close()] == [2]


def test_an_enqueue_that_failed_is_the_cause_and_names_its_operation():
    """The backend records the refused enqueue in the lifecycle; the watchdog reads it there (no
    call into the backend), aborts the communicator and makes the group's error, which every
    reader of the lifecycle then raises."""
    dog, failures = _watchdog()
    refused = EnqueueFailure("all_reduce of 4 x float32", 3, True, "could not be enqueued on rank 0 (boom)")
    dog.lifecycle.enqueue_failed(refused)
    assert dog.lifecycle.failing.is_set() and not dog.lifecycle.failed  # nothing new is enqueued meanwhile
    assert dog.poll_once(now=0.0) is True
    assert failures == [(None, "could not be enqueued on rank 0 (boom)")] and dog.comm.aborts == 1
    with pytest.raises(Exception, match="failed at idle: could not be enqueued on rank 0"):
        dog.lifecycle.raise_if_failed()


def test_an_abort_before_the_watchdogs_failure_keeps_the_first_error():
    dog, failures = _watchdog(async_errors=["failed: NCCL reported boom"])
    first = dog.lifecycle.fail(RuntimeError("aborted by the user"))
    assert dog.poll_once(now=0.0) is True  # the watchdog still fails what is outstanding
    assert dog.lifecycle.error is first and str(first) == "aborted by the user"
