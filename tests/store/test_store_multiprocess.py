"""Stores across real processes (spawn context): counters, compare_set races, wake-ups,
timeouts, and workers that start before their master.

Every case runs against each store kind a job can rendezvous through:

* ``tcp``        — TCPStore; the master (server) lives in the test process, every child is a
  client. On one host a distlib client reaches a distlib server over its same-host UNIX
  socket (client.py, "same-host transport"), so this is the UNIX path;
* ``tcp-no-unix`` — the same with ``DISTLIB_STORE_UNIX=0`` in the children: plain TCP;
* ``file``       — FileStore on one file in a temporary directory.

Every child reports through a queue: ``("ok", rank, result)`` or ``("error", rank,
traceback)``, so a failing child shows its own traceback in the test failure. Every join,
queue read and store wait has a timeout. The tests assert behaviour, never speed: where a
case is about time (a timeout must fire), the only bound is a generous one that catches a
hang.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
import traceback
from datetime import timedelta

import pytest

from distlib import DistStoreError
from distlib.deadline import Deadline
from distlib.store.file import SIDECAR_SUFFIX, FileStore
from distlib.store.tcp import TCPStore

CTX = multiprocessing.get_context("spawn")
JOIN_TIMEOUT = 120
STORE_TIMEOUT = 60.0
KINDS = ["tcp", "tcp-no-unix", "file"]


# -- the harness ------------------------------------------------------------------------------


def _child(target, rank, args, results):
    try:
        results.put(("ok", rank, target(rank, *args)))
    except BaseException:  # noqa: BLE001 - the parent shows it
        results.put(("error", rank, traceback.format_exc()))


def run_children(target, nproc, args=(), before_join=None, timeout=JOIN_TIMEOUT):
    """Run target(rank, *args) in nproc spawned processes; return {rank: result}.

    ``before_join()`` runs in the parent once the children are started (to release them,
    or to start a master they wait for). A child that fails makes this raise with the
    child's traceback; one that hangs makes it raise after ``timeout``.
    """
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
                status, rank, value = results.get(timeout=timeout)
            except Exception as exc:  # queue.Empty
                codes = {p.pid: p.exitcode for p in procs}
                raise AssertionError(f"a child did not report within {timeout}s (exit codes {codes})") from exc
            if status == "error":
                errors.append(f"--- child {rank} ---\n{value}")
            else:
                outcome[rank] = value
        assert not errors, "child process failed:\n" + "\n".join(errors)
        return outcome
    finally:
        for p in procs:
            p.join(timeout=timeout)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for p in procs:
            assert p.exitcode == 0, f"child pid {p.pid} exited with {p.exitcode}"


# -- stores, as the parent owns them and as children open them ------------------------------------


class Job:
    """The parent's side of one store: ``spec`` (picklable) tells a child how to open it."""

    def __init__(self, kind: str, tmp_path, nproc: int):
        self.kind = kind
        self.nproc = nproc
        if kind == "file":
            self.path = str(tmp_path / "store")
            # world_size: the children and the parent must all leave before the file goes
            self.main = FileStore(self.path, nproc + 1)
            self.main.set_timeout(timedelta(seconds=STORE_TIMEOUT))
            self.spec = ("file", self.path, nproc + 1)
        else:
            self.main = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=STORE_TIMEOUT), wait_for_workers=False)
            self.spec = ("tcp", "127.0.0.1", self.main.port, kind != "tcp-no-unix")

    def close(self) -> None:
        self.main.close()
        if self.kind == "file":
            assert not os.path.exists(self.path), "the last FileStore user did not remove the file"
            assert not os.path.exists(self.path + SIDECAR_SUFFIX)


def open_store(spec, timeout: float = STORE_TIMEOUT):
    """A child's store from a Job's spec."""
    if spec[0] == "file":
        store = FileStore(spec[1], spec[2])
        store.set_timeout(timedelta(seconds=timeout))
        return store
    _, host, port, same_host_socket = spec
    os.environ["DISTLIB_STORE_UNIX"] = "1" if same_host_socket else "0"
    store = TCPStore(host, port, None, False, timedelta(seconds=timeout))
    expected = "unix" if same_host_socket else "tcp"
    assert store.transport == expected, f"connected over {store.transport}, expected {expected}"
    return store


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def wait_for_count(store, key: str, count: int, timeout: float = STORE_TIMEOUT) -> None:
    """Until counter ``key`` reaches ``count`` (children check in with add)."""
    store.wait([key], timedelta(seconds=timeout))
    deadline = Deadline(timeout)
    while int(store.get(key)) < count:
        assert not deadline.expired(), f"{key} stuck at {store.get(key)!r}, wanted {count}"
        time.sleep(0.01)


def release_when_ready(job: Job, nproc: int, ready_key: str = "ready", go_key: str = "go"):
    def release():
        wait_for_count(job.main, ready_key, nproc)
        job.main.set(go_key, "1")

    return release


# -- children (module level: spawn imports them by name) ----------------------------------------


def _adder(rank, spec, times):
    store = open_store(spec)
    try:
        store.add("ready", 1)
        store.wait(["go"])
        return [store.add("counter", 1) for _ in range(times)]
    finally:
        store.close()


def _racer(rank, spec):
    store = open_store(spec)
    try:
        store.add("ready", 1)
        store.wait(["go"])
        mine = f"rank{rank}".encode()
        got = store.compare_set("leader", "", mine)
        return got == mine, got
    finally:
        store.close()


def _waiter(rank, spec, use_get):
    store = open_store(spec)
    try:
        store.add("waiting", 1)
        if use_get:
            value = store.get("go")  # blocks up to the store timeout
        else:
            store.wait(["go"], timedelta(seconds=STORE_TIMEOUT))
            value = store.get("go")
        return value
    finally:
        store.close()


def _missing_getter(rank, spec, seconds):
    store = open_store(spec)
    try:
        store.set_timeout(timedelta(seconds=seconds))
        start = time.monotonic()
        try:
            store.get(f"never/set/{rank}")
        except Exception as exc:  # noqa: BLE001 - inspected by the parent
            return type(exc).__name__, isinstance(exc, DistStoreError), str(exc), time.monotonic() - start
        return "no error", False, "", time.monotonic() - start
    finally:
        store.close()


def _early_worker(rank, host, port, world_size, results_key, marker_dir):
    """A worker started before its master exists: it keeps connecting until the master is up."""
    open(os.path.join(marker_dir, f"connecting.{rank}"), "w").close()
    store = TCPStore(host, port, world_size, False, timedelta(seconds=STORE_TIMEOUT))
    try:
        store.set(f"{results_key}/{rank}", f"hello from {rank}")
        store.add(results_key, 1)
        return store.get("master/says")
    finally:
        store.close()


def _two_transports(rank, host, port):
    store = open_store(("tcp", host, port, rank % 2 == 0))
    try:
        store.set(f"from/{rank}", store.transport)
        store.add("arrived", 1)
        store.wait(["all/arrived"])
        return {k: store.get(f"from/{k}") for k in range(4)}
    finally:
        store.close()


def _fails_on_rank_one(rank):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


# -- tests --------------------------------------------------------------------------------------


def test_sixteen_processes_add_exactly(kind, tmp_path):
    nproc, times = 16, 1000
    job = Job(kind, tmp_path, nproc)
    returned = run_children(_adder, nproc, (job.spec, times), before_join=release_when_ready(job, nproc))
    assert job.main.get("counter") == str(nproc * times).encode()
    every = sorted(v for values in returned.values() for v in values)
    assert every == list(range(1, nproc * times + 1)), "each add must return a distinct running total"
    job.close()


def test_concurrent_compare_set_has_one_winner(kind, tmp_path):
    nproc = 8
    job = Job(kind, tmp_path, nproc)
    outcome = run_children(_racer, nproc, (job.spec,), before_join=release_when_ready(job, nproc))
    winners = [rank for rank, (won, _) in outcome.items() if won]
    assert len(winners) == 1
    leader = f"rank{winners[0]}".encode()
    assert all(got == leader for _, got in outcome.values())
    assert job.main.get("leader") == leader
    job.close()


@pytest.mark.parametrize("use_get", [False, True], ids=["wait", "get"])
def test_one_set_wakes_every_waiter(kind, use_get, tmp_path):
    """N processes block (wait, or get) on a key; one set wakes all of them, none times out."""
    nproc = 6
    job = Job(kind, tmp_path, nproc)

    def release():
        wait_for_count(job.main, "waiting", nproc)
        job.main.set("go", "now")

    outcome = run_children(_waiter, nproc, (job.spec, use_get), before_join=release)
    assert outcome == {r: b"now" for r in range(nproc)}
    job.close()


def test_get_on_a_missing_key_times_out_naming_the_key(kind, tmp_path):
    nproc, seconds = 3, 0.5
    job = Job(kind, tmp_path, nproc)
    outcome = run_children(_missing_getter, nproc, (job.spec, seconds))
    for rank, (name, is_store_error, text, elapsed) in outcome.items():
        assert is_store_error, f"child {rank}: {name}: {text}"
        assert f"never/set/{rank}" in text
        assert "500ms" in text
        # it gave up, and not before its time; the upper bound only catches a hang
        assert seconds * 0.9 <= elapsed < seconds + 10, elapsed
    job.close()


@pytest.mark.parametrize("nproc", [4])
def test_tcp_workers_started_before_the_master_all_join(nproc, tmp_path):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    box = {}

    def start_master_late():
        # every worker is about to connect (and finds nobody listening) before the master starts
        deadline = Deadline(JOIN_TIMEOUT)
        while len([n for n in os.listdir(tmp_path) if n.startswith("connecting.")]) < nproc:
            assert not deadline.expired(), "the workers did not start"
            time.sleep(0.02)
        time.sleep(0.2)  # and has had its first refusal
        # the master's constructor returns once all nproc workers have joined (init/)
        box["master"] = TCPStore("127.0.0.1", port, nproc + 1, True, timedelta(seconds=STORE_TIMEOUT))
        wait_for_count(box["master"], "joined", nproc)
        box["master"].set("master/says", "welcome")

    outcome = run_children(_early_worker, nproc, ("127.0.0.1", port, nproc + 1, "joined", str(tmp_path)),
                           before_join=start_master_late)
    master = box["master"]
    assert outcome == {r: b"welcome" for r in range(nproc)}
    assert [master.get(f"joined/{r}") for r in range(nproc)] == [f"hello from {r}".encode() for r in range(nproc)]
    master.close()


def test_tcp_same_host_socket_and_tcp_clients_share_one_server():
    """Children alternate between the same-host UNIX socket and TCP; one store for all."""
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=STORE_TIMEOUT), wait_for_workers=False)

    def release():
        wait_for_count(master, "arrived", 4)
        master.set("all/arrived", "1")

    outcome = run_children(_two_transports, 4, ("127.0.0.1", master.port), before_join=release)
    expected = {k: (b"unix" if k % 2 == 0 else b"tcp") for k in range(4)}
    assert all(view == expected for view in outcome.values())
    master.close()


def test_children_failures_are_reported():
    """The harness itself: a failing child's traceback reaches the assertion message."""
    with pytest.raises(AssertionError, match="(?s)child 1.*ValueError: boom from rank 1"):
        run_children(_fails_on_rank_one, 3, ())
