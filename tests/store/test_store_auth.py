"""The store with a token (DISTLIB_AUTH_TOKEN): who gets in, what everyone else is told.

Every server here is a real StoreServer (a thread, or `distlib store-server` in a process)
and every client a real TCPStore or a raw socket playing a peer that does not know the token.
"""

from __future__ import annotations

import logging
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from distlib import auth
from distlib.errors import DistNetworkError, DistStoreError
from distlib.store.tcp import StoreServer, TCPStore
from distlib.store.tcp import codec as proto
from distlib.store.tcp.security import StoreSecurity
from tests.fixtures.ports import free_port
from tests.fixtures.sockets import recv_exact

TOKEN = b"correct-horse-battery-staple"
SERVER_LOG = "distlib.store.tcp.server"


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0, security=StoreSecurity(TOKEN), log_connections=True).start()
    yield srv
    srv.stop()


def client(port, token=TOKEN, seconds=5.0, **kwargs):
    return TCPStore("127.0.0.1", port, timeout=timedelta(seconds=seconds), security=StoreSecurity(token), **kwargs)


def refusals(caplog):
    return [r.getMessage() for r in caplog.records if r.name == SERVER_LOG and "refused" in r.getMessage()]



@pytest.mark.parametrize("unix", [True, False], ids=["same-host-socket", "tcp"])
def test_a_client_with_the_token_is_served(server, monkeypatch, unix):
    monkeypatch.setenv("DISTLIB_STORE_UNIX", "1" if unix else "0")
    store = client(server.port)
    assert store.transport == ("unix" if unix else "tcp")
    store.set("k", b"v" * 100_000)
    assert store.get("k") == b"v" * 100_000
    assert store.add("n", 2) == 2
    store.close()


@pytest.mark.parametrize("unix", [True, False], ids=["same-host-socket", "tcp"])
def test_a_wrong_token_fails_at_once_and_the_server_names_the_peer(server, monkeypatch, caplog, unix):
    monkeypatch.setenv("DISTLIB_STORE_UNIX", "1" if unix else "0")
    caplog.set_level(logging.INFO, SERVER_LOG)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=rf"authentication to 127.0.0.1:{server.port} failed: wrong token"):
        client(server.port, token=b"not-the-token-at-all", seconds=30)
    assert time.monotonic() - start < 5  # at once, not at the 30 s timeout
    peer = "127.0.0.1:unix (pid " if unix else "127.0.0.1:"
    assert any(peer in m and "refused: wrong token" in m for m in refusals(caplog)), caplog.text


def test_a_client_without_the_token_is_told_the_store_requires_one(server, caplog):
    caplog.set_level(logging.INFO, SERVER_LOG)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=rf"the store at 127.0.0.1:{server.port} requires authentication: "
                                             r"set DISTLIB_AUTH_TOKEN"):
        client(server.port, token=None, seconds=30)
    assert time.monotonic() - start < 5
    deadline = time.monotonic() + 5
    while not refusals(caplog) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert refusals(caplog), caplog.text


def test_a_torch_style_client_reads_the_challenge_as_a_wrong_ping_echo(server, caplog):
    """torch's client sends VALIDATE and PING and reads a 4-byte echo: it gets the challenge's
    first bytes, which can never equal its pid, and fails at once ("Ping failed")."""
    caplog.set_level(logging.INFO, SERVER_LOG)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(proto.validate() + proto.ping(4242))
    assert recv_exact(sock, 4) == b"DIST"
    sock.close()
    deadline = time.monotonic() + 5
    while not refusals(caplog) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert any("a client without DISTLIB_AUTH_TOKEN (torch clients cannot authenticate)" in m
               or "gives up at the challenge" in m for m in refusals(caplog)), caplog.text


def test_nothing_an_unauthenticated_peer_sends_is_run_or_stored(server):
    """A peer that answers the challenge with requests instead of a proof: refused (REFUSED,
    then EOF), and none of its requests ran."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert recv_exact(sock, auth.CHALLENGE_BYTES).startswith(auth.MAGIC)
    attack = proto.validate() + proto.set_(b"/rank0/addr", b"10.6.6.6:1") + proto.add(b"/n", 1)
    sock.sendall(attack + b"\0" * 64)
    assert recv_exact(sock, 2) == bytes([auth.REFUSED])  # then the server closed
    sock.close()
    good = client(server.port)
    assert not good.check(["rank0/addr"])
    assert good.num_keys() == 0
    good.close()


def test_a_replayed_response_does_not_get_in(server):
    """A recorded exchange is worthless: the server's nonce differs on every connection."""
    recorder = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    challenge = recv_exact(recorder, auth.CHALLENGE_BYTES)
    response, _, _ = auth.respond(TOKEN, challenge)
    recorder.close()
    replay = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    recv_exact(replay, auth.CHALLENGE_BYTES)
    replay.sendall(response + proto.validate() + proto.ping(1))
    assert recv_exact(replay, 2) == bytes([auth.REFUSED])
    replay.close()


def test_a_client_with_the_token_refuses_a_store_without_it():
    open_server = StoreServer("127.0.0.1", 0, security=StoreSecurity()).start()
    try:
        start = time.monotonic()
        with pytest.raises(DistStoreError, match=r"does not ask for authentication, but DISTLIB_AUTH_TOKEN is set here"):
            client(open_server.port, seconds=30)
        assert time.monotonic() - start < 5
    finally:
        open_server.stop()


def test_an_impostor_that_accepts_without_the_token_is_refused():
    """A listener that speaks the challenge but does not know the token cannot prove it: the
    client refuses it before sending a single request."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    got = bytearray()

    def impostor():
        conn, _ = listener.accept()
        message, _ = auth.challenge()
        conn.sendall(message)
        response = recv_exact(conn, auth.RESPONSE_BYTES)
        conn.sendall(bytes([auth.ACCEPTED]) + response[32:])  # no token: echo whatever it can
        conn.settimeout(2)
        try:
            while True:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                got.extend(chunk)
        except OSError:
            pass
        conn.close()

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with pytest.raises(DistStoreError, match="could not prove that it holds DISTLIB_AUTH_TOKEN"):
        client(listener.getsockname()[1])
    thread.join(5)
    listener.close()
    assert proto.set_(b"/", b"")[:1] not in bytes(got[15:])  # only the handshake went out, no request


class DelayingProxy:
    """TCP proxy in front of ``port``: the first connection's server-to-client bytes are held
    back ``delay`` seconds (a server too slow to send its challenge in time)."""

    def __init__(self, port: int, delay: float):
        self.upstream, self.delay = port, delay
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            up = socket.create_connection(("127.0.0.1", self.upstream))
            delay = self.delay if self.connections == 1 else 0.0
            threading.Thread(target=self._pump, args=(down, up, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, delay), daemon=True).start()

    @staticmethod
    def _pump(src, dst, delay):
        time.sleep(delay)
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.listener.close()


def test_a_challenge_that_comes_late_makes_the_client_connect_again(server, monkeypatch):
    """Past its patience the client asks for the TCPStore handshake; when the challenge comes
    after all (a slow server, not one without the token), it connects again and waits."""
    monkeypatch.setenv("DISTLIB_STORE_UNIX", "0")
    proxy = DelayingProxy(server.port, delay=1.5)
    try:
        store = TCPStore("127.0.0.1", proxy.port, timeout=timedelta(seconds=10), security=StoreSecurity(TOKEN))
        store.set("late", "1")
        assert store.get("late") == b"1"
        assert proxy.connections == 2
        store.close()
    finally:
        proxy.close()


@pytest.mark.parametrize("token", [TOKEN, None], ids=["with-token", "no-token"])
def test_a_silent_service_on_the_port_is_named(token, monkeypatch, caplog):
    monkeypatch.setattr("distlib.store.tcp.handshake.SILENT_WARN_S", 0.5)
    caplog.set_level(logging.WARNING, "distlib.store.tcp.handshake")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(DistNetworkError) as info:
        client(port, token=token, seconds=2)
    assert 1.9 < time.monotonic() - start < 5
    text = str(info.value)
    assert text.startswith(f"The client socket has timed out after 2000ms while trying to connect to (127.0.0.1, {port})")
    assert f"127.0.0.1:{port} accepted the connection but did not answer" in text
    assert "within 2.0s: is another service on this port?" in text
    assert any("has not answered" in r.getMessage() for r in caplog.records)  # said early, in the log
    listener.close()


def test_the_in_process_master_takes_the_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("DISTLIB_AUTH_TOKEN", TOKEN.decode())
    master = TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=10), wait_for_workers=False)
    worker = TCPStore("127.0.0.1", master.port, 2, False, timedelta(seconds=10))  # the env's token too
    worker.set("x", "1")
    assert master.get("x") == b"1"
    with pytest.raises(DistStoreError, match="requires authentication"):
        TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=10), security=StoreSecurity())
    clone = worker.clone()
    assert clone.get("x") == b"1"
    for s in (clone, worker, master):
        s.close()


def test_a_token_too_short_is_refused_before_any_connection(monkeypatch):
    monkeypatch.setenv("DISTLIB_AUTH_TOKEN", "short")
    with pytest.raises(ValueError, match="DISTLIB_AUTH_TOKEN holds a token of 5 characters"):
        TCPStore("127.0.0.1", 1, timeout=timedelta(seconds=1))


# -- the service ----------------------------------------------------------------------------------


def test_store_server_with_a_token_file_and_its_ping(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN.decode() + "\n")
    port = free_port()
    log_file = open(tmp_path / "store-server.log", "w+")
    env_cli = [sys.executable, "-m", "distlib.cli", "store-server"]
    proc = subprocess.Popen(env_cli + ["--port", str(port), "--auth-token-file", str(token_file)],
                            stderr=log_file, text=True)
    try:
        ping = env_cli + ["--ping", f"127.0.0.1:{port}", "--timeout", "10", "--auth-token-file", str(token_file)]
        result = subprocess.run(ping, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert "ok (distlib server" in result.stdout
        result = subprocess.run(env_cli + ["--ping", f"127.0.0.1:{port}", "--timeout", "10"],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 1
        assert f"the store at 127.0.0.1:{port} requires authentication: set DISTLIB_AUTH_TOKEN" in result.stderr
    finally:
        proc.terminate()
        proc.wait(10)
    log_file.seek(0)
    text = log_file.read()
    assert "authentication: token required" in text
    assert "refused" in text


def test_store_server_refuses_a_token_file_it_cannot_use(tmp_path):
    short = tmp_path / "token"
    short.write_text("abc")
    result = subprocess.run([sys.executable, "-m", "distlib.cli", "store-server", "--port", str(free_port()),
                             "--auth-token-file", str(short)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "holds a token of 3 characters; use at least 16" in result.stderr


def test_a_raw_frame_does_not_mix_up_tokens():
    """The server's worker counting, handshake probe and requests work behind the token."""
    srv = StoreServer("127.0.0.1", 0, security=StoreSecurity(TOKEN)).start()
    try:
        worker = client(srv.port, world_size=1)
        assert srv.workers_joined == 1
        assert worker.ordered_waits
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        message = recv_exact(sock, auth.CHALLENGE_BYTES)
        response, nonce, listener_nonce = auth.respond(TOKEN, message)
        sock.sendall(response + proto.validate() + proto.ping(77) + proto.get(b"/missing"))
        verdict = recv_exact(sock, auth.VERDICT_BYTES)
        assert auth.verify_verdict(TOKEN, nonce, listener_nonce, verdict)
        assert recv_exact(sock, 4) == struct.pack("<I", 77)
        assert recv_exact(sock, 8) == b"\0" * 8
        sock.close()
        worker.close()
    finally:
        srv.stop()
