"""A rank that cannot reach its store says so at WARNING within seconds, and keeps saying it
while it retries (distlib/store/tcp/connect.py; docs/troubleshooting.md promises it). The case
users hit: MASTER_ADDR=127.0.0.1 in a container, where nobody else's store can be."""

from __future__ import annotations

import logging
import socket

import pytest

from distlib.deadline import Deadline
from distlib.errors import DistNetworkError
from distlib.store.tcp import TCPStore
from distlib.store.tcp import connect as connect_module
from distlib.store.tcp.connect import connect, loopback_hint


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def quick_warnings(monkeypatch):
    monkeypatch.setattr(connect_module, "WARN_AFTER_S", 0.3)
    monkeypatch.setattr(connect_module, "WARN_EVERY_S", 0.4)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "distlib.store.tcp.connect"]


def test_the_loopback_hint():
    assert loopback_hint("127.0.0.1").endswith("own loopback: is MASTER_ADDR right?)")
    assert loopback_hint("::1").endswith("own loopback: is MASTER_ADDR right?)")
    assert loopback_hint("10.0.0.7") == "" and loopback_hint("master") == ""


def test_connect_warns_while_it_retries_and_the_error_keeps_the_hint(quick_warnings, caplog):
    port = _closed_port()
    with caplog.at_level(logging.INFO, logger="distlib.store.tcp.connect"):
        with pytest.raises(DistNetworkError) as info:
            connect("127.0.0.1", port, Deadline(1.6))
    warned = _warnings(caplog)
    assert len(warned) >= 2, warned  # after 0.3 s, then every 0.4 s until the deadline
    refused = f"connection refused (nobody listening) at 127.0.0.1:{port} ("
    for text in warned:
        assert text.startswith(f"cannot reach TCPStore server 127.0.0.1:{port} after "), text
        assert refused in text and "own loopback: is MASTER_ADDR right?)" in text, text
        assert "retrying until the deadline" in text, text
    assert refused in str(info.value) and "is MASTER_ADDR right?" in str(info.value)


def test_a_store_client_of_an_address_nobody_serves_warns(quick_warnings, caplog):
    """What init_process_group's env:// does on a rank whose MASTER_ADDR is its own loopback."""
    port = _closed_port()
    with caplog.at_level(logging.WARNING, logger="distlib.store.tcp.connect"):
        with pytest.raises(DistNetworkError):
            TCPStore("127.0.0.1", port, 2, False, timeout=1.2)
    warned = _warnings(caplog)
    assert warned and all(f"127.0.0.1:{port}" in w and "MASTER_ADDR" in w for w in warned), warned


def test_a_store_found_at_once_says_nothing(caplog):
    server = TCPStore("127.0.0.1", 0, None, True, timeout=5, wait_for_workers=False)
    with caplog.at_level(logging.INFO, logger="distlib.store.tcp.connect"):
        client = TCPStore("127.0.0.1", server.port, None, False, timeout=5)
        client.set("k", "v")
    assert _warnings(caplog) == []
