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
