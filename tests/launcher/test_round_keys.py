"""A restarted elastic round's workers keep their keys apart from the round before: env:// on
the master service puts them under ``distlib/run/<run id>/attempt_<N>`` (rendezvous.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from distlib.rendezvous import rendezvous


@pytest.mark.parametrize("count, prefix", [("0", "distlib/run/job-1"), ("", "distlib/run/job-1"),
                                           ("2", "distlib/run/job-1/attempt_2")])
def test_the_restart_count_names_the_rounds_keys(store_server, monkeypatch, count, prefix):
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_server), "RANK": "0",
                        "WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job-1",
                        "TORCHELASTIC_RESTART_COUNT": count}.items():
        monkeypatch.setenv(name, value)
    store, _rank, _world = next(rendezvous("env://", timeout=timedelta(seconds=10)))
    assert store.prefix == prefix
    store.set("k", "round's own")
