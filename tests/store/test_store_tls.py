"""The store over TLS: a server certificate, a CA for clients, errors that name the failing check.

Certificates are made per session by tests/fixtures/certs.py. Clients connect over TCP
(DISTLIB_STORE_UNIX=0) unless a test is about the same-host socket, which stays plaintext.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from distlib.errors import DistStoreError
from distlib.store.tcp import StoreServer, TCPStore
from distlib.store.tcp import codec as proto
from distlib.store.tcp.security import StoreSecurity
from distlib.tls import PLAINTEXT_REFUSAL
from tests.fixtures import certs
from tests.fixtures.ports import free_port

TOKEN = b"tls-and-token-together-0001"
SERVER_LOG = "distlib.store.tcp.server"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return certs.make(tmp_path_factory.mktemp("pki"))


@pytest.fixture(autouse=True)
def tcp_only(monkeypatch):
    monkeypatch.setenv("DISTLIB_STORE_UNIX", "0")


def serve(pki, kind="good", token=None):
    return StoreServer("127.0.0.1", 0, security=StoreSecurity(token, pki[f"{kind}_cert"], pki[f"{kind}_key"])).start()


def connect(port, ca, token=None, host="127.0.0.1", seconds=5.0):
    return TCPStore(host, port, timeout=timedelta(seconds=seconds), security=StoreSecurity(token, ca=ca))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_a_client_that_trusts_the_ca_is_served_over_tls(pki, host):
    srv = StoreServer("" if host == "::1" else "127.0.0.1", 0,
                      security=StoreSecurity(None, pki["good_cert"], pki["good_key"])).start()
    try:
        store = connect(srv.port, pki["ca"], host=host)
        assert store.transport == "tcp" and type(store._sock).__name__ == "TlsSocket"
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert store.add("n", 5) == 5
        assert store.compare_set("k", "v", "w") == b"w"
        assert store.multi_get(["k", "n"]) == [b"w", b"5"]
        store.close()
    finally:
        srv.stop()


def test_large_values_and_pipelined_requests_cross_tls_whole(pki):
    """8 MiB values both ways (many TLS records, partial writes), a wait answered later, and
    a get pipelined behind it (the one-round-trip get)."""
    srv = serve(pki)
    try:
        a = connect(srv.port, pki["ca"])
        b = connect(srv.port, pki["ca"])
        big = bytes(range(256)) * (8 * 1024 * 1024 // 256)
        a.set("big", big)
        assert b.get("big") == big
        a.multi_set([f"k{i}" for i in range(500)], [bytes([i % 256]) * 20_000 for i in range(500)])
        values = b.multi_get([f"k{i}" for i in range(500)])
        assert all(v == bytes([i % 256]) * 20_000 for i, v in enumerate(values))
        import threading
        got = []
        t = threading.Thread(target=lambda: got.append(b.get("later")))
        t.start()
        time.sleep(0.2)
        a.set("later", b"x" * 100_000)
        t.join(10)
        assert got == [b"x" * 100_000]
        a.close()
        b.close()
    finally:
        srv.stop()


def test_tls_and_the_token_together(pki):
    srv = serve(pki, token=TOKEN)
    try:
        store = connect(srv.port, pki["ca"], token=TOKEN)
        store.set("k", "v")
        assert store.get("k") == b"v"
        store.close()
        with pytest.raises(DistStoreError, match="wrong token"):
            connect(srv.port, pki["ca"], token=b"another-token-of-enough-length")
        with pytest.raises(DistStoreError, match="requires authentication"):
            connect(srv.port, pki["ca"])
    finally:
        srv.stop()


@pytest.mark.parametrize("kind, ca, check", [
    ("good", "other_ca", r"its certificate is not signed by DISTLIB_TLS_CA \(unable to get local issuer certificate\)"),
    ("foreign", "ca", r"its certificate is not signed by DISTLIB_TLS_CA"),
    ("wrong_name", "ca", r"its certificate is not for this name \(IP address mismatch, certificate is not valid "
                         r"for '127.0.0.1'.\)"),
    ("expired", "ca", r"its certificate is outside its validity dates \(certificate has expired\)"),
])
def test_each_failed_check_is_named(pki, caplog, kind, ca, check):
    caplog.set_level(logging.WARNING, SERVER_LOG)
    srv = serve(pki, kind)
    try:
        start = time.monotonic()
        with pytest.raises(DistStoreError, match=rf"TLS to the store at 127.0.0.1:{srv.port} failed: {check}") as info:
            connect(srv.port, pki[ca], seconds=30)
        assert time.monotonic() - start < 5  # not retried until the timeout
        assert f"DISTLIB_TLS_CA={pki[ca]}" in str(info.value)
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any("refused: TLS handshake failed: the client" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        srv.stop()


def test_a_client_without_the_ca_is_told_the_store_requires_tls(pki, caplog):
    caplog.set_level(logging.WARNING, SERVER_LOG)
    srv = serve(pki)
    try:
        with pytest.raises(DistStoreError, match=rf"the store at 127.0.0.1:{srv.port} requires TLS: set DISTLIB_TLS_CA"):
            connect(srv.port, None, seconds=30)
        assert any("speaks plaintext (a TCPStore handshake) to a store that requires TLS" in r.getMessage()
                   for r in caplog.records), caplog.text
    finally:
        srv.stop()


def test_a_torch_style_client_fails_at_once_on_a_tls_store(pki):
    """torch has no TLS: its VALIDATE + PING gets a TLS alert, whose first 4 bytes it reads as
    a wrong PING echo ("Ping failed")."""
    srv = serve(pki)
    try:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        sock.sendall(proto.validate() + proto.ping(4242))
        data = b""
        while len(data) < len(PLAINTEXT_REFUSAL):
            chunk = sock.recv(64)
            if not chunk:
                break
            data += chunk
        assert data == PLAINTEXT_REFUSAL
        sock.close()
    finally:
        srv.stop()


def test_a_tls_client_of_a_plain_store_is_told_it_does_not_serve_tls(pki):
    srv = StoreServer("127.0.0.1", 0, security=StoreSecurity()).start()
    try:
        with pytest.raises(DistStoreError, match=r"does it serve TLS \(started with --tls-cert/--tls-key"):
            connect(srv.port, pki["ca"], seconds=30)
    finally:
        srv.stop()


def test_the_same_host_socket_stays_plaintext_and_of_this_user(pki, monkeypatch):
    """Same-host clients use the UNIX socket without TLS (no network on the way; the peer's
    user is checked instead), with the token still required."""
    monkeypatch.setenv("DISTLIB_STORE_UNIX", "1")
    srv = serve(pki, token=TOKEN)
    try:
        store = connect(srv.port, pki["ca"], token=TOKEN)
        assert store.transport == "unix"
        store.set("k", "v")
        assert store.get("k") == b"v"
        store.close()
    finally:
        srv.stop()


def test_a_certificate_that_does_not_match_its_key_is_a_clear_error(pki):
    with pytest.raises(ValueError, match=r"cannot load the TLS certificate DISTLIB_TLS_CERT=.*good_cert.pem with its "
                                         r"key DISTLIB_TLS_KEY=.*expired_key.pem: the key does not belong"):
        StoreServer("127.0.0.1", 0, security=StoreSecurity(None, pki["good_cert"], pki["expired_key"]))
    with pytest.raises(ValueError, match="TLS needs a certificate and its key: DISTLIB_TLS_KEY is not set"):
        _ = StoreSecurity(None, pki["good_cert"], "").server_tls
    with pytest.raises(ValueError, match=r"cannot load the TLS CA DISTLIB_TLS_CA=/nonexistent: No such file"):
        _ = StoreSecurity(ca="/nonexistent").client_tls


def test_the_master_and_its_workers_take_tls_from_the_environment(pki, monkeypatch):
    monkeypatch.setenv("DISTLIB_TLS_CERT", pki["good_cert"])
    monkeypatch.setenv("DISTLIB_TLS_KEY", pki["good_key"])
    monkeypatch.setenv("DISTLIB_TLS_CA", pki["ca"])
    master = TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=10), wait_for_workers=False)
    worker = TCPStore("127.0.0.1", master.port, 2, False, timedelta(seconds=10))
    assert type(worker._sock).__name__ == "TlsSocket"
    worker.set("x", "1")
    assert master.get("x") == b"1"
    worker.close()
    master.close()


def test_store_server_with_tls_flags_and_a_ping_that_checks_them(pki, tmp_path):
    port = free_port()
    cli = [sys.executable, "-m", "distlib.cli", "store-server"]
    log_file = open(tmp_path / "store-server.log", "w+")
    proc = subprocess.Popen(cli + ["--port", str(port), "--tls-cert", pki["good_cert"], "--tls-key", pki["good_key"]],
                            stderr=log_file, env={**_env_without_unix()})
    try:
        ping = cli + ["--ping", f"127.0.0.1:{port}", "--timeout", "10", "--tls-ca", pki["ca"]]
        result = subprocess.run(ping, capture_output=True, text=True, timeout=30, env=_env_without_unix())
        assert result.returncode == 0, result.stderr
        result = subprocess.run(cli + ["--ping", f"127.0.0.1:{port}", "--timeout", "10", "--tls-ca", pki["other_ca"]],
                                capture_output=True, text=True, timeout=30, env=_env_without_unix())
        assert result.returncode == 1
        assert "its certificate is not signed by DISTLIB_TLS_CA" in result.stderr
        assert f"--tls-ca={pki['other_ca']}" in result.stderr
    finally:
        proc.terminate()
        proc.wait(10)
    log_file.seek(0)
    assert "TLS: on (" in log_file.read()


def test_store_server_refuses_to_start_with_a_missing_certificate(tmp_path):
    result = subprocess.run([sys.executable, "-m", "distlib.cli", "store-server", "--port", str(free_port()),
                             "--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(tmp_path / "none.key")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "cannot load the TLS certificate --tls-cert=" in result.stderr and "No such file" in result.stderr


def _env_without_unix():
    import os

    env = dict(os.environ)
    env["DISTLIB_STORE_UNIX"] = "0"
    return env
