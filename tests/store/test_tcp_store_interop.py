"""torch's TCPStore and distlib's, mixed both ways on the wire (torch 2.13).

Needs torch importable: ``make test-interop`` (or ``/tmp/venv-torch/bin/python -m pytest -m
interop tests/store``). Three groups:

* **torch clients against a distlib server** — every operation both support, PrefixStore over
  it, worker counting and a distlib master waiting for torch workers;
* **distlib clients against torch servers**, libuv and legacy — the same operations; the
  distlib client notices it is not talking to a distlib server (the ordered-wait probe) and
  uses torch's WAIT-then-GET sequence, and survives libuv's spurious wake-ups;
* **rendezvous** — torch processes ``init_process_group("gloo", "tcp://...")`` through a
  standing ``distlib store-server`` with ``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank a
  client), then all_reduce.

The distlib server runs as a ``distlib store-server`` process, never as a thread of the test
process: torch's ``TCPStore`` constructor holds the GIL while it connects, so a Python server
thread in the same process could not answer its handshake (docs/stores.md).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="torch not importable: run `make test-interop`")
import torch.distributed as tdist  # noqa: E402

from distlib import DistStoreError, QueueEmptyError  # noqa: E402
from distlib.store import PrefixStore  # noqa: E402
from distlib.store.tcp import TCPStore  # noqa: E402
from distlib.store_service import StoreServerProcess  # noqa: E402
from tests.fixtures.ports import free_port  # noqa: E402
from tests.store.append_order import TRIES, slow_thread_switches, stale_reads  # noqa: E402,F401 - a fixture

pytestmark = pytest.mark.interop

TIMEOUT = timedelta(seconds=15)
SPAWN = multiprocessing.get_context("spawn")
JOIN_TIMEOUT = 180


def start_store_server(tmp_path, port: int) -> StoreServerProcess:
    """``distlib store-server`` on 127.0.0.1:port, logging at INFO; returned once it answers."""
    return StoreServerProcess(port=port, log_level="INFO",
                              log_path=str(tmp_path / f"store-server-{port}.log")).start(timeout=60)


def stop_store_server(server: StoreServerProcess) -> str:
    """Stop the server (SIGTERM, then SIGKILL); what it logged."""
    server.stop()
    return server.log_text()


@pytest.fixture
def distlib_server(tmp_path):
    """The port of a fresh ``distlib store-server``."""
    port = free_port()
    proc = start_store_server(tmp_path, port)
    yield port
    log = stop_store_server(proc)
    assert "Traceback" not in log, log


def torch_client(port: int, world_size=None, timeout=TIMEOUT, **kwargs):
    return tdist.TCPStore("127.0.0.1", port, world_size, False, timeout, **kwargs)


def distlib_client(port: int, world_size=None, timeout=TIMEOUT, **kwargs) -> TCPStore:
    return TCPStore("127.0.0.1", port, world_size, False, timeout, **kwargs)


@pytest.fixture(params=[True, False], ids=["libuv", "legacy"])
def torch_server(request):
    """(port, use_libuv) of a torch TCPStore server (its own C++ thread: no GIL needed)."""
    master = tdist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False, use_libuv=request.param)
    assert master.libuvBackend is request.param
    yield master.port, request.param, master
    del master


# -- the operations both implementations support, checked from both ends -----------------------


def exchange(store, peer, tag: str) -> None:
    """``store`` (the client under test) and ``peer`` (a client of the other implementation,
    same server) see each other's writes, for every operation both support. Every key starts
    with ``tag``, so that one server can host several exchanges."""
    t = tag
    # set / get, str and binary (NUL bytes and non-UTF-8 survive)
    store.set(t + "str", "hello")
    assert peer.get(t + "str") == b"hello"
    store.set(t + "bin", b"\x00\xff\x00binary\x80")
    assert peer.get(t + "bin") == b"\x00\xff\x00binary\x80"
    peer.set(t + "from_peer", b"\x01\x02")
    assert store.get(t + "from_peer") == b"\x01\x02"
    store.set(t + "empty", "")
    assert peer.get(t + "empty") == b""
    big = os.urandom(1 << 20)
    store.set(t + "big", big)
    assert peer.get(t + "big") == big

    # add: decimal ASCII, shared counter, negative deltas
    assert store.add(t + "cnt", 5) == 5
    assert peer.add(t + "cnt", 2) == 7
    assert store.add(t + "cnt", -10) == -3
    assert peer.get(t + "cnt") == b"-3"

    # compare_set, torch's four cases
    assert store.compare_set(t + "cs_absent", "expected", "desired") == b"expected"  # absent + expected: no change
    assert not peer.check([t + "cs_absent"])
    assert store.compare_set(t + "cs", "", "first") == b"first"  # absent + empty expected: created
    assert peer.compare_set(t + "cs", "wrong", "second") == b"first"  # present, mismatch: current
    assert store.compare_set(t + "cs", "first", "second") == b"second"  # present, match: swapped
    assert peer.get(t + "cs") == b"second"

    # check
    assert store.check([t + "str", t + "cnt"]) and peer.check([t + "str", t + "cnt"])
    assert not store.check([t + "str", t + "nope"])
    assert store.check([])

    # wait: present keys return; a missing one times out with torch's text, then the
    # connection is still usable
    store.wait([t + "str", t + "cs"])
    store.wait([t + "str"], timedelta(seconds=5))
    with pytest.raises(RuntimeError) as info:
        store.wait([t + "never_set"], timedelta(seconds=0.3))
    assert isinstance(info.value, (tdist.DistStoreError, DistStoreError))
    assert str(info.value).startswith(f"wait timeout after 300ms, keys: /{t}never_set")
    assert store.get(t + "str") == b"hello"

    # delete_key
    assert store.delete_key(t + "str") is True
    assert store.delete_key(t + "str") is False
    assert not peer.check([t + "str"])

    # append (creates, then extends). Fire-and-forget requests of two connections have no
    # order on the server until a reply orders them (the get waits for the key).
    store.append(t + "ap", "po")
    assert peer.get(t + "ap") == b"po"
    peer.append(t + "ap", "tato")
    assert peer.get(t + "ap") == b"potato"

    # multi_set / multi_get (order kept, binary values)
    store.multi_set([t + "m1", t + "m2", t + "m3"], ["one", b"\x00two", ""])
    assert peer.multi_get([t + "m3", t + "m1", t + "m2"]) == [b"", b"one", b"\x00two"]
    peer.multi_set([t + "m4"], ["four"])
    assert store.multi_get([t + "m4", t + "m1"]) == [b"four", b"one"]

    # list_keys: user keys, slash stripped, the same from both ends
    listed = sorted(store.list_keys())
    assert sorted(peer.list_keys()) == listed
    names = ("bin", "from_peer", "cnt", "cs", "ap", "m1", "m2", "m3", "m4", "empty", "big")
    assert {t + name for name in names} <= set(listed)
    assert t + "str" not in listed

    # num_keys agrees between the two clients
    assert store.num_keys() == peer.num_keys()

    # PrefixStore over either client: "pre/k" on the wire as "/pre/k"
    theirs = (tdist.PrefixStore if isinstance(store, tdist.Store) else PrefixStore)(t + "pre", store)
    theirs.set("k", "v")
    assert peer.get(t + "pre/k") == b"v"
    peers = (tdist.PrefixStore if isinstance(peer, tdist.Store) else PrefixStore)(t + "pre", peer)
    assert peers.get("k") == b"v"
    assert peers.add("n", 3) == 3 and theirs.add("n", 1) == 4


def queues(store, peer) -> None:
    store.queue_push("q", "1")
    assert store.queue_len("q") == 1  # a reply on the pushing connection: the push is in
    peer.queue_push("q", b"\x002")
    assert peer.queue_len("q") == 2 and store.queue_len("q") == 2
    assert store.check(["q"])  # a non-empty queue counts as present
    assert peer.queue_pop("q") == b"1"
    assert store.queue_pop("q", block=False) == b"\x002"
    with pytest.raises((QueueEmptyError, tdist.QueueEmptyError), match="empty"):
        peer.queue_pop("q", block=False)
    assert store.queue_len("q") == 0


# -- torch clients, distlib server ----------------------------------------------------------------


def test_torch_client_every_operation_against_distlib_server(distlib_server):
    theirs = torch_client(distlib_server)
    ours = distlib_client(distlib_server)
    assert ours.ordered_waits is True
    exchange(theirs, ours, "a/")
    exchange(ours, theirs, "b/")


def test_torch_client_queues_against_distlib_server(distlib_server):
    queues(torch_client(distlib_server), distlib_client(distlib_server))


def test_torch_client_blocking_get_and_queue_pop_woken_by_distlib(distlib_server):
    theirs = torch_client(distlib_server)
    ours = distlib_client(distlib_server)
    box = {}

    def block():
        box["get"] = theirs.get("late")
        box["pop"] = theirs.queue_pop("late_q")

    thread = threading.Thread(target=block)
    thread.start()
    time.sleep(0.2)
    ours.set("late", "value")
    ours.queue_push("late_q", "item")
    thread.join(20)
    assert not thread.is_alive()
    assert box == {"get": b"value", "pop": b"item"}


def test_torch_get_is_not_woken_by_a_compare_set_that_changes_nothing(distlib_server):
    """distlib's server wakes waiters only when a key is written (libuv also wakes on a
    no-op compare_set, and torch's own get then returns b"")."""
    theirs = torch_client(distlib_server, timeout=timedelta(seconds=1.5))
    other = torch_client(distlib_server)
    box = {}

    def block():
        try:
            box["value"] = theirs.get("never")
        except Exception as exc:  # noqa: BLE001 - inspected below
            box["error"] = exc

    thread = threading.Thread(target=block)
    thread.start()
    time.sleep(0.3)
    assert other.compare_set("never", "x", "y") == b"x"
    thread.join(20)
    assert "value" not in box, f"get returned {box.get('value')!r} for a key that was never set"
    assert "wait timeout" in str(box["error"]) and "/never" in str(box["error"])


def test_torch_barrier_and_its_timeout_against_distlib_server(distlib_server):
    first, second = torch_client(distlib_server), torch_client(distlib_server)
    done = []
    thread = threading.Thread(target=lambda: (first.barrier("b", 2, timedelta(seconds=10)), done.append(1)))
    thread.start()
    time.sleep(0.2)
    assert not done
    second.barrier("b", 2, timedelta(seconds=10))
    thread.join(20)
    assert done == [1]
    with pytest.raises(RuntimeError, match="barrier timeout after 300ms, key: lonely"):
        first.barrier("lonely", 2, timedelta(seconds=0.3))
    assert first.get("b") == b"2"  # the counter is an ordinary key


def test_torch_workers_count_in_init_key_on_distlib_server(distlib_server):
    ours = distlib_client(distlib_server)
    workers = [torch_client(distlib_server, world_size=3) for _ in range(3)]  # each: ADD "init/" 1
    assert ours.num_keys() == 1  # init/ (no slash: invisible to list_keys)
    assert ours.list_keys() == []
    workers[0].set("k", "v")
    assert workers[0].get("k") == b"v"  # a reply on the setting connection: the set is in
    assert ours.num_keys() == 2
    # wait_for_workers=False sends nothing
    torch_client(distlib_server, world_size=3, wait_for_workers=False)
    assert workers[1].num_keys() == 2


def _distlib_master(port, world_size, results):
    """A distlib master (server + wait_for_workers) in its own process; reports who joined."""
    try:
        master = TCPStore("127.0.0.1", port, world_size, True, timedelta(seconds=60))
        master.set("master/ready", "1")
        master.wait(["workers/done"], timedelta(seconds=60))
        results.put(("ok", sorted(master.list_keys())))
        master.close()
    except BaseException:  # noqa: BLE001 - the parent shows it
        results.put(("error", traceback.format_exc()))


def test_distlib_master_waits_for_torch_workers():
    """TCPStore(is_master=True, world_size=3) in distlib returns once two torch workers joined."""
    port = free_port()
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=_distlib_master, args=(port, 3, results), daemon=True)
    proc.start()
    try:
        # torch workers retry until the master listens; each adds 1 to init/
        workers = [torch_client(port, world_size=3, timeout=timedelta(seconds=60)) for _ in range(2)]
        assert workers[0].get("master/ready") == b"1"  # the master's constructor has returned
        workers[1].set("workers/done", "1")
        status, value = results.get(timeout=JOIN_TIMEOUT)
        assert status == "ok", value
        assert value == ["master/ready", "workers/done"]
    finally:
        proc.join(JOIN_TIMEOUT)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


# -- ordering: a torch client's fire-and-forget request, then the master's own read ------------


@pytest.mark.parametrize("master_impl", ["distlib", "torch"])
@pytest.mark.usefixtures("slow_thread_switches")
def test_master_handle_reads_after_a_torch_clients_append(master_impl):
    """The master handle (TCPStore(is_master=True), its server on a thread of this process)
    sets a key, a torch client in another process appends to it, the master reads it: the
    get must not overtake the APPEND the server had already received (append_order.py).
    torch's own master handle never does. Before the fix the distlib master read the old
    value in 4 to 40 of 40 tries: its server thread, waiting for this interpreter, had not
    read the master's SET when the APPEND arrived, and then read SET and GET together, ahead
    of it."""
    if master_impl == "distlib":
        master = TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
    else:
        master = tdist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
    stale = stale_reads(master, "torch")
    assert stale == [], (f"the {master_impl} master read {len(stale)} of {TRIES} keys without the torch "
                         f"client's append (expected b'ab'): {stale}")


# -- distlib clients, torch servers (libuv and legacy) -------------------------------------------


def test_distlib_client_every_operation_against_torch_server(torch_server):
    port, use_libuv, master = torch_server
    ours = distlib_client(port, use_libuv=use_libuv)
    assert ours.ordered_waits is False  # a torch server: torch's WAIT-then-GET sequence
    assert ours.transport == "tcp"  # no same-host socket on a torch server
    theirs = torch_client(port, use_libuv=use_libuv)
    exchange(ours, theirs, "a/")
    exchange(theirs, ours, "b/")


def test_distlib_client_queues_against_torch_server(torch_server):
    port, use_libuv, _ = torch_server
    ours = distlib_client(port, use_libuv=use_libuv)
    if not use_libuv:
        # as torch's client: a legacy-flagged client refuses queues itself
        with pytest.raises(NotImplementedError, match="queues not implemented on legacy TCPStore backend"):
            ours.queue_push("q", "1")
        return
    queues(ours, torch_client(port))


def test_distlib_get_survives_a_spurious_wake_up(torch_server):
    """libuv wakes a WAIT on a compare_set that changed nothing; torch's own get then returns
    b"". distlib's get must keep waiting and return the real value (legacy: no wake-up)."""
    port, use_libuv, _ = torch_server
    ours = distlib_client(port, use_libuv=use_libuv)
    theirs = torch_client(port, use_libuv=use_libuv)
    box = {}

    def block():
        try:
            box["value"] = ours.get("k")
        except Exception as exc:  # noqa: BLE001 - inspected below
            box["error"] = exc

    thread = threading.Thread(target=block)
    thread.start()
    time.sleep(0.3)
    assert theirs.compare_set("k", "x", "y") == b"x"  # changes nothing
    time.sleep(0.3)
    assert thread.is_alive() and not box, f"get returned early: {box}"
    theirs.set("k", "real")
    thread.join(20)
    assert box == {"value": b"real"}
    # and the connection is in step afterwards
    assert ours.add("after", 1) == 1


def test_distlib_wait_timeout_and_barrier_against_torch_server(torch_server):
    port, use_libuv, _ = torch_server
    ours = distlib_client(port, use_libuv=use_libuv)
    with pytest.raises(DistStoreError) as info:
        ours.wait(["missing"], timedelta(seconds=0.3))
    assert str(info.value).startswith("wait timeout after 300ms, keys: /missing")
    with pytest.raises(DistStoreError, match="missing"):
        ours.set_timeout(timedelta(seconds=0.3))
        ours.get("missing")
    ours.set_timeout(TIMEOUT)
    assert ours.add("still_usable", 2) == 2  # the cancel left the connection in step

    other = distlib_client(port, use_libuv=use_libuv)
    done = []
    thread = threading.Thread(target=lambda: (other.barrier("bar", 2, timedelta(seconds=10)), done.append(1)))
    thread.start()
    time.sleep(0.2)
    ours.barrier("bar", 2, timedelta(seconds=10))
    thread.join(20)
    assert done == [1]
    with pytest.raises(DistStoreError, match="barrier timeout after 300ms, key: alone"):
        ours.barrier("alone", 2, timedelta(seconds=0.3))


_WORKER_CODE = """
import sys
from datetime import timedelta
from distlib.store.tcp import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), 3, False, timedelta(seconds=60))
store.set("worker/" + sys.argv[2], "joined")
store.get("master/go")
"""


def test_torch_master_waits_for_distlib_workers(torch_server):
    """distlib workers (world_size given) count themselves in; torch's master returns."""
    _, use_libuv, _ = torch_server
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER_CODE, str(port), str(i)]) for i in range(2)]
    try:
        # the workers are already retrying; torch's master blocks until 3 have joined
        master = tdist.TCPStore("127.0.0.1", port, 3, True, timedelta(seconds=60), use_libuv=use_libuv)
        master.wait(["worker/0", "worker/1"])
        master.set("master/go", "1")
        for proc in procs:
            assert proc.wait(60) == 0
        assert sorted(master.list_keys()) == ["master/go", "worker/0", "worker/1"]
        assert master.num_keys() == 4  # + init/
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


# -- rendezvous: torch ranks through a standing distlib store-server --------------------------------


def _torch_rank(rank, world_size, port, results):
    try:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}?rank={rank}&world_size={world_size}",
            timeout=timedelta(seconds=60))
        tensor = torch.full((4,), float(rank + 1))
        dist.all_reduce(tensor)
        store = dist.distributed_c10d._get_default_store()
        dist.barrier()
        dist.destroy_process_group()
        results.put(("ok", rank, tensor.tolist(), type(store).__name__))
    except BaseException:  # noqa: BLE001 - the parent shows it
        results.put(("error", rank, traceback.format_exc(), None))


@pytest.mark.parametrize("world_size", [3])
def test_torch_ranks_rendezvous_through_distlib_store_server(tmp_path, world_size):
    """init_process_group("gloo", "tcp://...") with TORCHELASTIC_USE_AGENT_STORE=True: every
    torch rank (rank 0 too) is a client of the distlib store-server; all_reduce works."""
    port = free_port()
    server = start_store_server(tmp_path, port)
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=_torch_rank, args=(r, world_size, port, results), daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        outcome, errors = {}, []
        for _ in procs:
            status, rank, value, store_type = results.get(timeout=JOIN_TIMEOUT)
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{value}")
            else:
                outcome[rank] = value
        assert not errors, "\n".join(errors)
        total = float(sum(range(1, world_size + 1)))
        assert outcome == {r: [total] * 4 for r in range(world_size)}
        # the ranks' keys are on the distlib server: one per rank under the default group's
        # prefix (gloo's address exchange), besides the worker counter
        probe = distlib_client(port)
        group_keys = [k for k in probe.list_keys() if k.startswith("default_pg/")]
        assert len(group_keys) >= world_size, probe.list_keys()
        probe.close()
    finally:
        for p in procs:
            p.join(JOIN_TIMEOUT)
            if p.is_alive():
                p.kill()
                p.join(10)
        log = stop_store_server(server)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert log.count("connected") >= world_size, log


def test_a_torch_client_fails_when_its_distlib_master_restarts_and_a_distlib_client_goes_on(tmp_path):
    """docs/stores.md: torch's TCPStore client has no reconnect, so against a distlib master
    that restarts (with its state directory) it fails, as against torch's server; a distlib
    client of the same master reconnects and finds the key it wrote."""
    server = StoreServerProcess(port=free_port(), log_level="INFO", log_path=str(tmp_path / "master.log"),
                                args=["--state-dir", str(tmp_path / "state")]).start(timeout=60)
    try:
        theirs = torch_client(server.port)
        ours = distlib_client(server.port)
        theirs.set("torch-key", "1")
        ours.set("distlib-key", "2")
        assert ours.get("torch-key") == b"1"
        server.kill()
        server.start(timeout=60)
        with pytest.raises(Exception) as info:
            theirs.get("torch-key")
        assert not isinstance(info.value, AssertionError)
        assert ours.get("distlib-key") == b"2", "the distlib client did not come back with the key it wrote"
        assert ours.get("torch-key") == b"1", "the restarted master lost the torch client's key"
        ours.close()
    finally:
        server.stop()
