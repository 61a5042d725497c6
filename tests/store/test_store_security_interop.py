"""torch 2.13 and a store with a token or TLS: torch cannot join, and every side says so at once.

torch's TCPStore has neither authentication nor TLS. A torch client of a distlib store that
requires the token reads the challenge's first 4 bytes as its PING echo (the number
1414744388, the bytes "DIST"); of one that requires TLS, the TLS alert's (197397). torch 2.13
retries a failed PING until its timeout and then raises its own "Ping failed" error; the
server logs a refusal, with the client's address, for each attempt. A distlib client with
the token refuses a torch server at once (it cannot prove the token). Without a token or TLS
the wire is torch's: the rest of the interop tests (test_tcp_store_interop.py) run that way.
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="torch not importable: run `make test-interop`")
import torch.distributed as tdist  # noqa: E402

from distlib.errors import DistError, DistStoreError  # noqa: E402
from distlib.store.tcp import TCPStore  # noqa: E402
from distlib.store.tcp.security import StoreSecurity  # noqa: E402
from tests.fixtures.ports import free_port  # noqa: E402

pytestmark = pytest.mark.interop

TOKEN = "interop-token-0123456789"


def serve(tmp_path, *flags):
    """`distlib store-server` with ``flags`` on a free port, in its own process (torch's
    constructor holds the GIL while it connects: an in-process server could not answer)."""
    port = free_port()
    log = open(tmp_path / f"server-{port}.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "distlib.cli", "store-server", "--port", str(port), *flags],
                            stderr=log)
    deadline = time.monotonic() + 30
    while "listening on" not in (tmp_path / f"server-{port}.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"server-{port}.log").read_text()
        time.sleep(0.05)
    return proc, port


def stop(proc, tmp_path, port) -> str:
    proc.terminate()
    proc.wait(10)
    return (tmp_path / f"server-{port}.log").read_text()


def pki(tmp_path):
    pytest.importorskip("cryptography", reason="the test certificates need cryptography (the test extras)")
    from tests.fixtures import certs

    return certs.make(tmp_path / "pki")


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    return str(path)


def test_a_torch_client_of_a_store_with_a_token_gets_its_own_ping_error(tmp_path, token_file):
    proc, port = serve(tmp_path, "--auth-token-file", token_file)
    try:
        with pytest.raises(Exception, match=r"Ping failed, invalid value returned from server. Expected: \d+, "
                                            r"Got: 1414744388"):  # torch's DistNetworkError, at its timeout
            tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=3))
    finally:
        log = stop(proc, tmp_path, port)
    assert "or a torch client, gives up at the challenge" in log or "torch clients cannot authenticate" in log


def test_a_torch_client_of_a_store_with_tls_gets_its_own_ping_error(tmp_path):
    files = pki(tmp_path)
    proc, port = serve(tmp_path, "--tls-cert", files["good_cert"], "--tls-key", files["good_key"])
    try:
        with pytest.raises(Exception, match=r"Ping failed, invalid value returned from server. Expected: \d+, "
                                            r"Got: 197397"):
            tdist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=3))
    finally:
        log = stop(proc, tmp_path, port)
    assert "refused: it speaks plaintext (a TCPStore handshake) to a store that requires TLS" in log


@pytest.mark.parametrize("use_libuv", [True, False], ids=["libuv", "legacy"])
def test_a_distlib_client_with_a_token_refuses_a_torch_server(use_libuv):
    server = tdist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False,
                            use_libuv=use_libuv)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match="does not ask for authentication, but DISTLIB_AUTH_TOKEN is set here"):
        TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=30), security=StoreSecurity(TOKEN.encode()))
    assert time.monotonic() - start < 5
    del server


@pytest.mark.parametrize("use_libuv", [True, False], ids=["libuv", "legacy"])
def test_a_distlib_client_with_tls_of_a_torch_server_is_told_why(tmp_path, use_libuv, monkeypatch):
    """torch's servers do not speak TLS: the legacy one closes on the ClientHello, the libuv
    one keeps the bytes and says nothing; either way the error says what it waited for."""
    monkeypatch.setenv("DISTLIB_STORE_UNIX", "0")
    files = pki(tmp_path)
    server = tdist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False,
                            use_libuv=use_libuv)
    with pytest.raises(DistError, match=r"does it serve TLS|did not answer the TLS handshake"):
        TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=3), security=StoreSecurity(ca=files["ca"]))
    del server
