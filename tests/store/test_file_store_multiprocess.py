"""FileStore across real processes (spawn context): counters, compare_set races, wake-ups.

Every child reports through a queue: ``("ok", rank, result)`` or ``("error", rank,
traceback)``, so a failing child shows its own traceback in the test failure. Every join
and queue read has a timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from datetime import timedelta

import pytest

from distlib.deadline import Deadline
from distlib.store.file import SIDECAR_SUFFIX, FileStore

CTX = multiprocessing.get_context("spawn")
JOIN_TIMEOUT = 120


def _child(target, rank, args, results):
    try:
        results.put(("ok", rank, target(rank, *args)))
    except BaseException:  # noqa: BLE001 - the parent shows it
        results.put(("error", rank, traceback.format_exc()))


def run_children(target, nproc, args=(), before_join=None):
    """Run target(rank, *args) in nproc spawned processes; return {rank: result}."""
    results = CTX.Queue()
    procs = [CTX.Process(target=_child, args=(target, r, args, results), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    try:
        if before_join is not None:
            before_join()
        outcome = {}
        errors = []
        for _ in procs:
            try:
                status, rank, value = results.get(timeout=JOIN_TIMEOUT)
            except Exception as exc:  # queue.Empty
                codes = {p.pid: p.exitcode for p in procs}
                raise AssertionError(f"a child did not report within {JOIN_TIMEOUT}s (exit codes {codes})") from exc
            if status == "error":
                errors.append(f"--- child {rank} ---\n{value}")
            else:
                outcome[rank] = value
        assert not errors, "child process failed:\n" + "\n".join(errors)
        return outcome
    finally:
        for p in procs:
            p.join(timeout=JOIN_TIMEOUT)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for p in procs:
            assert p.exitcode == 0, f"child pid {p.pid} exited with {p.exitcode}"


# -- children (module level: spawn imports them by name) ----------------------------------------


def _adder(rank, path, world_size, times):
    with FileStore(path, world_size) as store:
        store.set_timeout(timedelta(seconds=60))
        store.add("ready", 1)
        store.wait(["go"])
        last = 0
        for _ in range(times):
            last = store.add("counter", 1)
        return last


def _racer(rank, path, world_size):
    with FileStore(path, world_size) as store:
        store.set_timeout(timedelta(seconds=60))
        store.add("ready", 1)
        store.wait(["go"])
        mine = f"rank{rank}".encode()
        got = store.compare_set("leader", "", mine)
        return got == mine, got


def _waiter(rank, path, world_size):
    with FileStore(path, world_size) as store:
        store.set_timeout(timedelta(seconds=60))
        store.add("waiting", 1)
        store.wait(["go"])
        return store.get("go")


def _wait_for_count(store, key, count):
    """Poll until counter `key` reaches `count` (bounded by the store timeout)."""
    store.wait([key])
    deadline = Deadline(store.timeout.total_seconds())
    while int(store.get(key)) < count:
        assert not deadline.expired(), f"{key} stuck at {store.get(key)!r}, wanted {count}"
        time.sleep(0.01)


# -- tests --------------------------------------------------------------------------------------


def test_sixteen_processes_add_exactly(tmp_path):
    path = str(tmp_path / "counter")
    nproc, times = 16, 1000
    main = FileStore(path, nproc + 1)
    main.set_timeout(timedelta(seconds=120))

    def release():
        _wait_for_count(main, "ready", nproc)
        main.set("go", "1")

    finals = run_children(_adder, nproc, (path, nproc + 1, times), before_join=release)
    assert main.get("counter") == str(nproc * times).encode()
    assert max(finals.values()) == nproc * times
    assert len(set(finals.values())) == nproc  # every add returned a distinct total
    main.close()
    assert not os.path.exists(path)
    assert not os.path.exists(path + SIDECAR_SUFFIX)


def test_concurrent_compare_set_has_one_winner(tmp_path):
    path = str(tmp_path / "race")
    nproc = 8
    main = FileStore(path, nproc + 1)
    main.set_timeout(timedelta(seconds=120))

    def release():
        _wait_for_count(main, "ready", nproc)
        main.set("go", "1")

    outcome = run_children(_racer, nproc, (path, nproc + 1), before_join=release)
    winners = [rank for rank, (won, _) in outcome.items() if won]
    assert len(winners) == 1
    leader = f"rank{winners[0]}".encode()
    assert all(got == leader for _, got in outcome.values())
    assert main.get("leader") == leader
    main.close()


def test_one_set_wakes_every_waiter(tmp_path):
    path = str(tmp_path / "wake")
    nproc = 6
    main = FileStore(path, nproc + 1)
    main.set_timeout(timedelta(seconds=120))

    def release():
        _wait_for_count(main, "waiting", nproc)
        main.set("go", "now")

    outcome = run_children(_waiter, nproc, (path, nproc + 1), before_join=release)
    assert outcome == {r: b"now" for r in range(nproc)}
    main.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize("nproc", [3])
def test_children_failures_are_reported(tmp_path, nproc):
    """The harness itself: a failing child's traceback reaches the assertion message."""
    with pytest.raises(AssertionError, match="(?s)child 1.*ValueError"):
        run_children(_fails_on_rank_one, nproc, ())


def _fails_on_rank_one(rank):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank
