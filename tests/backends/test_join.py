"""Joining a group (backends/join.py): the errors a rank gets when others never arrive or the
store goes away, whichever step of the join it is in."""

from __future__ import annotations

import json
import time

import pytest

from distlib import DistNetworkError, DistStoreError
from distlib.backends.join import local_facts, publish_and_gather
from distlib.deadline import Deadline
from distlib.store import HashStore


class StoreThatDiesAfterTheWait(HashStore):
    """The race of a rank-0-hosted store: this rank's wait runs out, and by the time it asks
    who joined (for its timeout error) rank 0 has given up and closed the server."""

    def check(self, keys):
        raise DistNetworkError("Failed to recv from TCPStore server 127.0.0.1:1 during CHECK: "
                               "Connection reset by peer")

    def describe(self):
        return "TCPStore server 127.0.0.1:1"


def test_every_rank_arrived_returns_the_records_in_rank_order():
    store = HashStore()
    store.set("join/1", json.dumps({"hostname": "b"}))
    records = publish_and_gather(store, 0, 2, {"hostname": "a"}, Deadline(2.0), "pg0/gloo rank 0")
    assert [r["hostname"] for r in records] == ["a", "b"]


def test_a_missing_rank_is_named_after_the_timeout():
    store = HashStore()
    store.set("join/0", json.dumps({"hostname": "node0", "node": 0, "local_world_size": 1}))
    with pytest.raises(DistStoreError) as info:
        publish_and_gather(store, 1, 3, {"hostname": "node1", "node": 1, "local_world_size": 1},
                           Deadline(0.3), "pg0/gloo rank 1")
    text = str(info.value)
    assert "timed out after 300ms waiting for every rank to join: 2/3 joined" in text, text
    assert "never arrived: rank 2 expected on node 2, from which no rank arrived" in text, text


def test_a_store_lost_while_writing_the_timeout_error_is_reported_as_lost():
    with pytest.raises(DistStoreError) as info:
        publish_and_gather(StoreThatDiesAfterTheWait(), 1, 2, {"hostname": "b"}, Deadline(0.2),
                           "pg0/gloo rank 1")
    text = str(info.value)
    assert not isinstance(info.value, DistNetworkError)
    assert text.startswith("pg0/gloo rank 1: lost the store at TCPStore server 127.0.0.1:1 (rank 0 gave up?)"), text
    assert "before this rank could see which ranks had arrived" in text, text
    assert "its error names the ranks that never arrived" in text and "Connection reset by peer" in text, text


class StoreThatDiesLater(HashStore):
    """Rank 0's store, up for ``life`` seconds (this rank polls who is missing meanwhile), then
    gone: rank 0 gave up first and its process exited."""

    def __init__(self, life: float):
        super().__init__()
        self.dies_at = time.monotonic() + life

    def _alive(self):
        if time.monotonic() >= self.dies_at:
            raise DistNetworkError("Failed to recv from TCPStore server 127.0.0.1:1 during WAIT: "
                                   "Connection reset by peer")

    def wait(self, keys, timeout=None):
        self._alive()
        super().wait(keys, min(timeout, max(0.001, self.dies_at - time.monotonic())))
        self._alive()

    def check(self, keys):
        self._alive()
        return super().check(keys)

    def describe(self):
        return "TCPStore server 127.0.0.1:1"


def test_a_store_lost_before_the_timeout_names_the_ranks_last_seen_missing():
    store = StoreThatDiesLater(1.0)
    store.set("join/0", json.dumps({"hostname": "a"}))
    started = time.monotonic()
    with pytest.raises(DistStoreError) as info:
        publish_and_gather(store, 1, 4, {"hostname": "b"}, Deadline(3.0), "pg0/gloo rank 1")
    assert time.monotonic() - started < 2.0  # at once when the store goes, not at the deadline
    text = str(info.value)
    assert text.startswith("pg0/gloo rank 1: lost the store at TCPStore server 127.0.0.1:1 (rank 0 gave up?) "), text
    assert "while waiting for ranks 2, 3 (the last look" in text, text


def test_a_second_claim_of_a_rank_fails_at_once_naming_both_and_the_group_reports_it():
    store = HashStore()
    first = {"hostname": "node-a", "pid": 101, "process": "aaaa"}
    store.set("join/0", json.dumps({"hostname": "node-z", "pid": 7}))
    store.compare_set("join/1", "", json.dumps(first))
    started = time.monotonic()
    with pytest.raises(ValueError) as info:
        publish_and_gather(store, 1, 3, {"hostname": "node-b", "pid": 202, "process": "bbbb"}, Deadline(5.0),
                           "pg0/gloo rank 1")
    assert time.monotonic() - started < 1.0
    text = str(info.value)
    assert "rank 1 was claimed twice: first by host node-a pid 101, then by host node-b pid 202" in text, text
    assert json.loads(store.get("join/1")) == first  # the first claim is kept
    # the rank that claimed first goes on; when the group cannot complete, its error says why
    with pytest.raises(DistStoreError) as info:
        publish_and_gather(store, 0, 3, {"hostname": "node-z", "pid": 7}, Deadline(0.5), "pg0/gloo rank 0")
    text = str(info.value)
    assert "never arrived: rank 2" in text, text
    assert "Duplicate claims: rank 1 was claimed twice: first by host node-a pid 101, then by host node-b pid 202" \
        in text, text


def test_this_process_claiming_its_rank_again_on_the_same_store_is_not_a_duplicate():
    store = HashStore()
    store.set("join/1", json.dumps({"hostname": "b"}))
    old = dict(local_facts(), mesh_id=1)
    assert publish_and_gather(store, 0, 2, old, Deadline(1.0), "pg0/gloo rank 0")[0] == old
    new = dict(local_facts(), mesh_id=2)  # init, destroy, init again: a new record, the same process
    assert publish_and_gather(store, 0, 2, new, Deadline(1.0), "pg0/gloo rank 0")[0] == new


# -- real processes ------------------------------------------------------------------------------


def _init(rank, world_size, init_method, timeout_s, delay_s=0.0):
    """init_process_group in this process: ("ok", seconds) or (error text, seconds), with
    (hostname, pid) to name this process."""
    import socket as socket_module
    from datetime import timedelta

    import distlib as dist

    time.sleep(delay_s)
    me = (socket_module.gethostname(), __import__("os").getpid())
    started = time.monotonic()
    kwargs = {} if rank is None else {"rank": rank, "world_size": world_size}
    try:
        dist.init_process_group("gloo", init_method=init_method, timeout=timedelta(seconds=timeout_s), **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started, me
    dist.destroy_process_group()
    return "ok", time.monotonic() - started, me


def test_a_rank_outside_the_world_fails_before_any_network_wait():
    from tests.backends.procs import Proc
    from tests.fixtures.ports import free_port

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "DISTLIB_SHM": "0"}  # nothing listens
    cases = [
        ({"RANK": "5", "WORLD_SIZE": "3"}, None, "env://",
         "rank 5 (RANK=5, from the environment) is outside [0, 3) for world size 3 (WORLD_SIZE=3, from the "
         "environment): ranks go from 0 to 2"),
        ({"RANK": "-1", "WORLD_SIZE": "3"}, None, "env://",
         "rank -1 (RANK=-1, from the environment) is outside [0, 3)"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, None, "env://",
         "the world size must be at least 1, but it is 0 (WORLD_SIZE=0, from the environment)"),
        ({}, 3, f"tcp://127.0.0.1:{env['MASTER_PORT']}",
         "rank 3 (rank=3, from the rank= argument) is outside [0, 3) for world size 3 (world_size=3, from the "
         "world_size= argument)"),
    ]
    procs = [Proc(_init, rank, 3, url, 60.0, env=dict(env, **extra)) for extra, rank, url, _ in cases]
    for proc, (_, _, url, expected) in zip(procs, cases, strict=True):
        status, (text, seconds, _) = proc.result(60)
        assert status == "ok", text
        assert text.startswith(f"ValueError: Error initializing torch.distributed using {url[:3]}"), text
        assert expected in text, text
        assert seconds < 10.0, (seconds, text)  # the 60 s timeout never started


def test_a_second_process_claiming_a_rank_fails_at_once_naming_both_and_the_group_reports_it():
    from tests.backends.procs import Proc
    from tests.fixtures.ports import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    env = {"DISTLIB_SHM": "0"}
    rank0 = Proc(_init, 0, 3, init, 10.0, env=env)
    first = Proc(_init, 1, 3, init, 10.0, 0.0, env=env)
    second = Proc(_init, 1, 3, init, 10.0, 1.5, env=env)  # rank 2 never comes
    results = {"rank 0": rank0.result(60), "a": first.result(60), "b": second.result(60)}
    for status, value in results.values():
        assert status == "ok", value
    (text0, _, _) = results["rank 0"][1]
    ones = [results["a"][1], results["b"][1]]
    quick = [r for r in ones if r[0].startswith("ValueError")]
    assert len(quick) == 1, ones  # whichever claimed second; the other went on
    loser_text, loser_seconds, loser = quick[0]
    winner_text, _, winner = [r for r in ones if r is not quick[0]][0]
    both = f"rank 1 was claimed twice: first by host {winner[0]} pid {winner[1]}, then by host {loser[0]} pid {loser[1]}"
    assert both in loser_text, loser_text
    assert loser_seconds < 8.0, (loser_seconds, loser_text)  # not its 10 s timeout
    # the group cannot complete: rank 0's error names rank 2 and the duplicate, and so does the
    # first rank 1's, whether it read the store at its deadline or lost it when rank 0 exited
    assert "timed out after 10.0s waiting for every rank to join: 2/3 joined; never arrived: rank 2" in text0, text0
    assert "never arrived: rank 2" in winner_text or "while waiting for ranks 2 (the last look" in winner_text, \
        winner_text
    for text in (text0, winner_text):
        assert "Duplicate claims: " + both in text, text


@pytest.mark.parametrize("run", range(5))
def test_both_ranks_of_a_2_of_3_join_name_the_missing_rank(run):
    """Rank 0 hosts the store and gives up first (rank 1 starts later) or at about the same
    time: either way rank 1's error names rank 2, whether it read the store at its deadline or
    lost it when rank 0 exited."""
    from tests.backends.procs import Proc
    from tests.fixtures.ports import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    env = {"DISTLIB_SHM": "0"}
    delay = [0.0, 0.3, 0.8, 1.2, 0.0][run]
    rank0 = Proc(_init, 0, 3, init, 3.0, env=env)
    rank1 = Proc(_init, 1, 3, init, 3.0, delay, env=env)
    results = [rank0.result(60), rank1.result(60)]
    for status, (text, seconds, _) in results:
        assert status == "ok", text
        assert seconds < 3.0 + 2.0, (seconds, text)
        named = ("never arrived: rank 2 " in text
                 or "(rank 0 gave up?)" in text and "while waiting for ranks 2 (the last look" in text)
        assert named, text
