"""Joining a group (backends/join.py): the errors a rank gets when others never arrive or the
store goes away, whichever step of the join it is in."""

from __future__ import annotations

import json

import pytest

from distlib import DistNetworkError, DistStoreError
from distlib.backends.join import publish_and_gather
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
    assert text.startswith("pg0/gloo rank 1: lost the store (TCPStore server 127.0.0.1:1)"), text
    assert "its error names the ranks that never arrived" in text and "Connection reset by peer" in text, text
