"""distlib/store_service.py: `distlib store-server` as a child process, up and answering
when start() returns, gone after stop(), with a clear error when it cannot come up."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from distlib.store import TCPStore
from distlib import store_service
from distlib.store_service import StoreServerProcess


def test_started_answering_and_stopped_cleanly(tmp_path):
    log = tmp_path / "server.log"
    with StoreServerProcess("127.0.0.1", log_level="INFO", log_path=str(log)) as server:
        assert server.endpoint == f"127.0.0.1:{server.port}"
        client = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=5))
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
        proc = server.proc
    assert proc.returncode == 0  # SIGTERM: the server shuts down cleanly
    assert "shutting down" in log.read_text()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


def test_a_port_taken_before_the_server_binds_it_is_replaced(monkeypatch):
    taken = socket.create_server(("127.0.0.1", 0))
    ports = iter([taken.getsockname()[1]])
    real = store_service.free_port
    monkeypatch.setattr(store_service, "free_port", lambda host="127.0.0.1": next(ports, None) or real(host))
    try:
        with StoreServerProcess("127.0.0.1") as server:
            assert server.port != taken.getsockname()[1]
            TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=5)).close()
    finally:
        taken.close()


def test_a_fixed_port_that_is_taken_is_an_error_naming_it(tmp_path):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    server = StoreServerProcess("127.0.0.1", port, log_path=str(tmp_path / "log"))
    try:
        with pytest.raises(RuntimeError, match=rf"store-server on 127.0.0.1:{port} did not answer within 15 s: "
                                               r"it exited with status 1"):
            server.start()
        assert "Address already in use" in server.log_text() or "in use" in server.log_text()
    finally:
        taken.close()
        server.stop()


def test_a_server_that_never_answers_in_time_is_stopped():
    server = StoreServerProcess("127.0.0.1")
    with pytest.raises(RuntimeError, match="did not answer within 0 s"):
        server.start(timeout=0.001)
    assert server.proc is not None, "no server was started: nothing to stop"
    assert server.proc.poll() is not None  # nothing left running
