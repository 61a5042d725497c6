"""A distlib client whose connection drops reconnects within its reconnect_timeout, re-sends
what was in flight, and a numbered write is applied once (client.py ``_resume``; the server's
sessions.py); torch's behaviour (fail at once) with ``reconnect_timeout=0``."""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta

import pytest

from distlib import DistNetworkError
from distlib.store.tcp import TCPStore
from distlib.store.tcp.security import StoreSecurity
from distlib.store.tcp.server import StoreServer

pytestmark = pytest.mark.timeout(60)

OPEN = StoreSecurity()
CLIENT_LOG = "distlib.store.tcp.client"


class DroppingProxy:
    """A TCP proxy between a client and a server that, when armed, closes the client's
    connection instead of forwarding the server's next reply: the request ran, its reply is
    lost, as when a master dies between applying a write and answering it."""

    def __init__(self, server_port: int):
        self.server_port = server_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.dropped = 0
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(("127.0.0.1", self.server_port))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if replies and self.armed.is_set():
                    self.armed.clear()
                    self.dropped += 1
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def server(tmp_path):
    server = StoreServer("127.0.0.1", 0, security=OPEN, state_dir=str(tmp_path / "state")).start()
    yield server
    server.stop()


def lines(caplog, text: str):
    return [r.getMessage() for r in caplog.records if r.name == CLIENT_LOG and text in r.getMessage()]


@pytest.mark.parametrize("operation", ["add", "compare_set", "append", "multi_set", "delete_key", "queue_pop"])
def test_a_write_whose_reply_was_lost_is_applied_once(server, caplog, operation):
    proxy = DroppingProxy(server.port)
    store = TCPStore("127.0.0.1", proxy.port, timeout=timedelta(seconds=10), security=OPEN)
    store.set("gone", b"x")
    store.queue_push("q", b"front")
    store.queue_push("q", b"back")
    proxy.armed.set()
    with caplog.at_level(logging.INFO, CLIENT_LOG):
        if operation == "add":
            assert store.add("n", 3) == 3
        elif operation == "compare_set":
            assert store.compare_set("c", b"", b"first") == b"first"
        elif operation == "append":
            store.append("a", b"tail")
        elif operation == "multi_set":
            store.multi_set(["m1", "m2"], [b"1", b"2"])
        elif operation == "delete_key":
            assert store.delete_key("gone") is True, "the re-sent DELETE_KEY did not get the first reply"
        else:
            assert store.queue_pop("q") == b"front"
        # (a request without reply is confirmed by the next one: its reply is the one dropped)
        assert store.num_keys() >= 1
    assert proxy.dropped == 1 and proxy.connections == 2, (proxy.dropped, proxy.connections)
    checker = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10), security=OPEN)
    expected = {"add": ("n", b"3"), "compare_set": ("c", b"first"), "append": ("a", b"tail"),
                "multi_set": ("m2", b"2")}
    if operation in expected:
        key, value = expected[operation]
        assert checker.get(key) == value, f"{operation} re-sent after the drop was applied twice"
    elif operation == "queue_pop":
        assert checker.queue_len("q") == 1, "the re-sent QUEUE_POP popped a second value"
    assert len(lines(caplog, "lost the connection to the store")) == 1
    back = lines(caplog, "reconnected to the store")
    assert len(back) == 1 and f"127.0.0.1:{proxy.port}" in back[0], back
    checker.close()
    store.close()
    proxy.close()


def test_a_restarted_server_is_found_again_with_its_keys(tmp_path, caplog):
    state = str(tmp_path / "state")
    server = StoreServer("127.0.0.1", 0, security=OPEN, state_dir=state).start()
    port = server.port
    store = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=20), security=OPEN)
    store.set("before", b"kept")
    assert store.add("n", 1) == 1
    server.stop()
    got = {}
    waiter = threading.Thread(target=lambda: got.update(value=store.get("after")))  # in flight across the restart
    with caplog.at_level(logging.INFO, CLIENT_LOG):
        waiter.start()
        again = StoreServer("127.0.0.1", port, security=OPEN, state_dir=state).start()
        try:
            other = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=20), security=OPEN)
            other.set("after", b"new")
            waiter.join(20)
            assert got.get("value") == b"new", "the GET in flight across the restart did not resume"
            assert store.get("before") == b"kept"
            assert store.add("n", 1) == 2
            other.close()
        finally:
            store.close()
            again.stop()
    started = lines(caplog, "lost the connection to the store")
    assert len(started) == 1 and f"127.0.0.1:{port} during GET" in started[0] and "for at most 20.0s" in started[0], \
        started
    assert len(lines(caplog, "reconnected to the store")) == 1


def test_past_the_reconnect_timeout_the_error_names_the_store_and_the_time(server):
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10), security=OPEN, reconnect_timeout=1)
    port = server.port
    server.stop()
    with pytest.raises(DistNetworkError, match=f"lost the connection to the store 127.0.0.1:{port} during ADD and "
                                               f"could not reconnect within 1.0s"):
        store.add("n", 1)
    store.close()


def test_reconnect_timeout_zero_fails_at_once_as_torch(server):
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10), security=OPEN, reconnect_timeout=0)
    server.stop()
    with pytest.raises(DistNetworkError, match="closed|Failed to"):
        store.add("n", 1)
    store.close()


def test_the_reconnect_window_comes_from_the_environment_where_the_code_passes_none(server, monkeypatch):
    """init_process_group's store takes no reconnect_timeout: DISTLIB_STORE_RECONNECT_TIMEOUT is
    the knob, and a master gone for good is named after that window, not the store timeout."""
    monkeypatch.setenv("DISTLIB_STORE_RECONNECT_TIMEOUT", "0.5")
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=60), security=OPEN)
    port = server.port
    server.stop()
    started = time.monotonic()
    with pytest.raises(DistNetworkError, match=f"store 127.0.0.1:{port} during ADD and could not reconnect within "
                                               "500ms"):
        store.add("n", 1)
    assert time.monotonic() - started < 10, "the client reconnected for longer than DISTLIB_STORE_RECONNECT_TIMEOUT"
    store.close()
