"""The nccl backend's time, failure and teardown on the fake device (fake_cuda.py), without a
GPU: destroy keeps results (issue 25, 1), a silent or dead rank is an error naming it and
never a crash or a hang, at 2 and 3 ranks, env:// and file://, lazy and eager communicators
(2), and the watchdog's work per operation does not grow with the operations in flight (3).
Ranks are real processes; the fake's collectives finish only when every rank has enqueued
them, and it reports any unsafe use of a communicator (two threads, or use after abort)."""

import os

import pytest

from tests.collectives.harness import spawn
from tests.fixtures.ports import free_port

from . import fake_cases


def answers(results, where):
    """Each rank's value; a rank without one is reported with its exit status and what the
    fake saw (a SIGSEGV here is the fake's stand-in for the GPU's)."""
    seen = ""
    path = os.path.join(where, "fake", "violations.txt")
    if os.path.exists(path):
        with open(path) as f:
            seen = f.read()
    values = []
    for rank, (code, outcome) in enumerate(results):
        died = f"died of signal {-code}" if code is not None and code < 0 else f"exit {code}"
        assert outcome is not None, f"rank {rank} gave no answer ({died}); the fake NCCL saw: {seen or 'nothing'}"
        status, value = outcome
        assert status == "ok", f"rank {rank} ({died}):\n{value}"
        values.append(value)
    return values


@pytest.mark.parametrize("subgroup", [False, True], ids=["world", "subgroup"])
@pytest.mark.parametrize("device_id", [None, 0], ids=["lazy", "eager"])
def test_destroy_keeps_the_result_of_an_enqueued_all_reduce(device_id, subgroup, tmp_path):
    """all_reduce, then destroy_process_group at once, while the kernel still runs: every rank
    reads 1 + 2 = 3 afterwards (torch >= 2.6 flushes; an abort here loses the result)."""
    where = str(tmp_path)
    for rank, (value, took, violations) in enumerate(answers(
            spawn(fake_cases.destroy_after_all_reduce, 2, where, device_id, subgroup, timeout=120), where)):
        assert value == [3.0], f"rank {rank} read {value} after destroy, not the all_reduce's 3.0"
        assert took < 20, f"rank {rank}: destroy took {took:.1f}s"
        assert violations == [], violations


#: World size, store, device_id: every value of each at least twice; a rank that exits at two.
CASES = [(2, "env", None), (2, "file", 0), (3, "file", 0), (3, "env", None), (3, "file", None), (2, "env", 0)]
SILENT = [(how, *case) for how in ("barrier", "loop") for case in CASES] + \
    [("exit", 2, "file", 0), ("exit", 3, "env", None)]


@pytest.mark.parametrize("how,ws,store,device_id", SILENT,
                         ids=[f"{h}-ws{w}-{s}-{'eager' if d == 0 else 'lazy'}" for h, w, s, d in SILENT])
def test_a_silent_rank_is_named_and_nobody_crashes_or_hangs(ws, store, device_id, how, tmp_path):
    """Rank 1 issues collectives #1 and #2 and then goes silent ("barrier", "loop": it sleeps;
    "exit": it is gone). The others issue #3 and wait in barrier(), or keep enqueueing (the
    watchdog then aborts while they enqueue: the probable GPU crash); each raises the
    watchdog's error naming rank 1 after the timeout, refuses the next call naming it, and
    destroys at once; the silent rank's own destroy returns too."""
    laggard, timeout_s = 1, 3.0
    where = str(tmp_path)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())} if store == "env" else {}
    results = spawn(fake_cases.silent_rank, ws, where, store, device_id, laggard, how, timeout_s,
                    0.05 if how == "loop" else 0.0, timeout=150, env=env)
    if how == "exit":
        assert results[laggard][0] == 3, f"the exiting rank's status: {results[laggard]}"
        results = [r for i, r in enumerate(results) if i != laggard]
    values = answers(results, where)
    assert fake_cases.silent_rank_problems(values, ws, laggard, how, timeout_s) == []


@pytest.mark.parametrize("ws", [1, 2])
def test_refusals_come_before_anything_is_enqueued(ws, tmp_path):
    """The GPU test's refusals and their texts (gpu_cases.refusal_problems), on the fake."""
    from . import gpu_cases

    where = str(tmp_path)
    for rank, (seen, still, violations) in enumerate(answers(spawn(fake_cases.refusals, ws, where, timeout=120),
                                                             where)):
        assert gpu_cases.refusal_problems(seen, still, ws) == [] and violations == [], f"rank {rank}"


def test_abort_process_group_discards_what_is_pending(tmp_path):
    where = str(tmp_path)
    for rank, (value, took, waited, initialized, violations) in enumerate(
            answers(spawn(fake_cases.abort_discards, 2, where, timeout=120), where)):
        assert value == [rank + 1.0] * 2, f"rank {rank}: an aborted all_reduce wrote {value}"
        assert took < 3, f"rank {rank}: _abort_process_group took {took:.1f}s"
        assert "aborted" in waited, f"rank {rank}: the pending Work's wait() said {waited!r}"
        assert not initialized and violations == [], (initialized, violations)


# -- in this process, one rank: the pending-work bookkeeping ----------------------------------


@pytest.fixture
def one_rank():
    """A group of one on the fake device, in this process; the real probe's answer after."""
    from datetime import timedelta

    import distlib as dist
    from distlib.backends import cupy_env

    from distlib.testing.fake_gpu import cuda as fake_cuda

    fake_cuda.install()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60),
                            device_id=0)
    try:
        yield dist, fake_cuda, dist.distributed.get_default_group().backends["cuda"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        cupy_env.status(refresh=True)


def _until(predicate, seconds=30.0):
    import time

    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "the condition did not come true within 30 s"
        time.sleep(0.001)


def test_the_watchdog_asks_only_the_oldest_operation_whatever_is_in_flight(one_rank):
    """2,000 all_reduces in flight behind a held device: each watchdog round asks the oldest
    operation's event and no other (issue 25: every round walked the whole list, and a call
    cost grew with the queue); once the device runs, each Work is settled, in order."""
    dist, fake, backend = one_rank
    import numpy as np

    x = fake.cupy.asarray(np.ones(4, np.float32))
    release = fake.hold()
    works = [dist.all_reduce(x, async_op=True) for _ in range(2000)]
    head, rest = works[0]._event, [w._event for w in works[1:]]
    _until(lambda: head.asked >= 3)  # three watchdog rounds at least
    asked_beyond_head = sum(e.asked for e in rest)
    release.set()
    _until(lambda: backend.watchdog.outstanding() == 0)
    assert asked_beyond_head == 0, (f"while the oldest of 2000 operations was running, the watchdog asked "
                                    f"{asked_beyond_head} events behind it (its work grows with the queue)")
    assert all(w.is_completed() and w.exception() is None for w in works)
    assert x.get().tolist() == [1.0] * 4 and fake.violations == []


def test_a_future_and_a_barrier_see_the_device_finish(one_rank):
    dist, fake, backend = one_rank
    import numpy as np

    x = fake.cupy.asarray(np.full(2, 5.0, np.float32))
    release = fake.hold()
    work = dist.all_reduce(x, async_op=True)
    assert isinstance(work, dist.Work)  # NcclWork implements the Work protocol
    future = work.get_future()
    assert not work.is_completed() and not future.done()
    release.set()
    assert future.wait() == [x] and work.is_success()
    dist.barrier()  # blocks the host until the device has run it
    assert backend.watchdog.outstanding() in (0, 1) and fake.violations == []


class _FakeDevice:
    """collectives_cuda._Device's part that per_call_round uses, on the fake: a held stream is a
    held device, released after ``seconds``."""

    def __init__(self, fake):
        self.fake = fake

    def upload_new(self, host):
        return self.fake.cupy.asarray(host)

    def download(self, dev, host):
        dev.get(out=host)

    def synchronize(self):
        self.fake.Device(0).synchronize()

    def spin(self, seconds):
        import threading

        release = self.fake.hold()
        threading.Timer(seconds, release.set).start()
        return release

    def finished(self, event):
        return event.is_set()


@pytest.mark.parametrize("calls,in_flight", [(300, False), (10, True), (2000, True)])
def test_the_benchs_per_call_round_on_the_fake(one_rank, calls, in_flight):
    """distlib bench collectives --device cuda's per-call rows, run on the fake device: every
    call was still in flight when the next was issued, and the result is checked."""
    from distlib_bench import collectives_cuda

    dist, fake, backend = one_rank
    reply = collectives_cuda.per_call_round(dist, _FakeDevice(fake), 0, 1, calls, in_flight)
    assert reply["wrong"] is None and reply["per_call_s"] > 0
    assert reply["held"] is (True if in_flight else None), reply


def test_a_mismatched_collective_fails_the_group_and_it_stays_failed(tmp_path):
    """float32[4] against float32[8] at 2 ranks (issue 37): the watchdog's timeout fails the
    group on both ranks; every later operation is refused on both, naming that failure, and
    the destroy returns at once."""
    timeout_s = 3.0
    where = str(tmp_path)
    values = answers(spawn(fake_cases.mismatch_stays_failed, 2, where, timeout_s, timeout=120), where)
    for rank, (first, later, took, violations) in enumerate(values):
        assert "(collective #1 in this group) timed out after" in first, f"rank {rank}: {first!r}"
        succeeded = [name for name, text in later if text == "no error"]
        assert succeeded == [], f"rank {rank}: these succeeded on the failed group: {succeeded}"
        for name, text in later:
            assert "aborted by an earlier failure" in text and first in text, f"rank {rank}, {name}: {text!r}"
        assert took < 10 and violations == [], (rank, took, violations)
