"""The store server under bad and hostile clients, and the `distlib store-server` service.

A malformed or oversized frame closes that client's connection only, with a log line; a
stalled or non-reading client never delays the others (the attacks of issue 20 are
test_store_attacks.py).
"""

from __future__ import annotations

import logging
import resource
import signal
import socket
import struct
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from distlib.store.tcp import StoreServer, TCPStore
from distlib.store.tcp import codec as proto
from distlib.store_service import StoreServerProcess
from tests.fixtures.sockets import closed_by_server, recv_exact

HELLO = proto.validate() + proto.ping(1234)


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0).start()
    yield srv
    srv.stop()


def raw(server, hello=True):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    if hello:
        sock.sendall(HELLO)
        assert recv_exact(sock, 4) == struct.pack("<I", 1234)
    return sock


def until(condition, what: str, within: float = 5.0) -> None:
    """Wait until ``condition()`` holds (the server's loop runs on its own thread)."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        time.sleep(0.001)


def waiters_of(server, key: bytes) -> list:
    """The server's connections waiting for ``key``."""
    return list(server.state.waiters.get(key, ()))


def healthy(server) -> bool:
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=5))
    store.set("probe", "ok")
    ok = store.get("probe") == b"ok"
    store.close()
    return ok


def test_garbage_instead_of_handshake_closes_only_that_client(server, caplog):
    caplog.set_level(logging.WARNING, "distlib.store.tcp.server")
    bad = raw(server, hello=False)
    bad.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert closed_by_server(bad)
    assert healthy(server)
    assert any("first message must be VALIDATE" in r.getMessage() for r in caplog.records)


def test_wrong_magic_is_rejected(server):
    bad = raw(server, hello=False)
    bad.sendall(b"\x00\xde\xad\xbe\xef")
    assert closed_by_server(bad)


def test_split_validate_and_separate_ping_are_fine(server):
    sock = raw(server, hello=False)
    for piece in (b"\x00\xce", b"\xf7\x85", b"\x3c", proto.ping(7)):
        sock.sendall(piece)
        time.sleep(0.02)
    assert recv_exact(sock, 4) == struct.pack("<I", 7)


def test_unknown_opcode_closes_with_a_log_line(server, caplog):
    caplog.set_level(logging.WARNING, "distlib.store.tcp.server")
    bad = raw(server)
    bad.sendall(b"\x13")
    assert closed_by_server(bad)
    assert any("unknown opcode 0x13" in r.getMessage() for r in caplog.records)
    assert healthy(server)


def test_oversized_length_closes_at_once_without_waiting_for_the_bytes(server, caplog):
    caplog.set_level(logging.WARNING, "distlib.store.tcp.server")
    bad = raw(server)
    bad.sendall(b"\x01" + struct.pack("<Q", 1 << 40))  # a 1 TiB key, announced, never sent
    assert closed_by_server(bad, within=3)
    assert any("exceeds the limit" in r.getMessage() for r in caplog.records)
    huge_value = raw(server)
    huge_value.sendall(b"\x01" + proto.blob(b"/k") + struct.pack("<Q", proto.MAX_VALUE_BYTES + 1))
    assert closed_by_server(huge_value, within=3)
    assert healthy(server)


def test_truncated_frame_then_disconnect(server):
    bad = raw(server)
    bad.sendall(proto.set_(b"/half", b"x" * 100)[:20])
    bad.close()
    assert healthy(server)


def test_stalled_client_does_not_delay_others(server):
    stalled = raw(server)
    stalled.sendall(proto.set_(b"/stall", b"y" * 1000)[:50])  # half a request, then nothing
    start = time.monotonic()
    assert healthy(server)
    assert time.monotonic() - start < 2
    stalled.sendall(proto.set_(b"/stall", b"y" * 1000)[50:])  # finishing it later still works
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=5))
    assert store.get("stall") == b"y" * 1000


def test_deferred_wait_reply_does_not_block_a_pipelined_cancel(server):
    """A torch client's only request behind a pending WAIT: CANCEL_WAIT, answered at once."""
    sock = raw(server)
    sock.sendall(proto.keys_request(proto.Op.WAIT, [b"/nothing"]))
    until(lambda: len(waiters_of(server, b"/nothing")) == 1, "the WAIT on /nothing registered")
    sock.sendall(proto.bare_request(proto.Op.CANCEL_WAIT))
    assert recv_exact(sock, 1) == b"\x01"
    sock.sendall(proto.bare_request(proto.Op.GETNUMKEYS))
    assert len(recv_exact(sock, 8)) == 8


def test_requests_behind_a_wait_run_in_order_after_it(server):
    """The GET and ADD sent behind a pending WAIT are held, unanswered, until the key is set,
    then answered in order after the WAIT's STOP_WAITING (the GET sees the value)."""
    sock = raw(server)
    sock.sendall(proto.keys_request(proto.Op.WAIT, [b"/later"]) + proto.get(b"/later") + proto.add(b"/n", 2))
    until(lambda: [len(conn.held or ()) for conn in waiters_of(server, b"/later")] == [2],
          "the WAIT on /later registered with the GET and the ADD held behind it")
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing answered before the key exists
        sock.recv(1)
    sock.settimeout(5)
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=5))
    store.set("later", "here")
    assert recv_exact(sock, 1 + 8 + 4 + 8) == b"\x00" + proto.blob(b"here") + struct.pack("<q", 2)


def test_waiter_that_disconnects_is_forgotten(server):
    sock = raw(server)
    sock.sendall(proto.keys_request(proto.Op.WAIT, [b"/gone"]))
    until(lambda: len(waiters_of(server, b"/gone")) == 1, "the WAIT on /gone registered")
    assert server.state.wait_bytes > 0
    sock.close()
    until(lambda: b"/gone" not in server.state.waiters, "the closed connection's WAIT on /gone forgotten")
    assert server.state.wait_bytes == 0  # nothing of the wait stays charged
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=5))
    store.set("gone", "1")
    assert healthy(server)


def test_a_wide_wake_up_reaches_every_waiter_once(caplog):
    """One set wakes 199 waiters in one loop turn. Every waiter gets exactly its replies,
    in order (STOP_WAITING, then what it queued behind the wait); one that vanished
    meanwhile is closed; the server goes on."""
    srv = StoreServer("127.0.0.1", 0)
    srv.start()
    try:
        socks = [raw(srv) for _ in range(200)]
        for i, sock in enumerate(socks):
            request = proto.keys_request(proto.Op.WAIT, [b"/go"])
            if i % 2:  # half queue requests behind the wait: several replies for one connection
                request += proto.get(b"/go") + proto.add(b"/n", 1)
            sock.sendall(request)
        gone = socks.pop(7)
        gone.close()
        deadline = time.monotonic() + 5
        while len(srv.state.waiters.get(b"/go", ())) < len(socks) and time.monotonic() < deadline:
            time.sleep(0.01)
        store = TCPStore("127.0.0.1", srv.port, timeout=timedelta(seconds=5))
        store.set("go", "x")
        counts = []
        for i, sock in enumerate(socks):
            sock.settimeout(5)
            assert recv_exact(sock, 1) == b"\x00"
            if (i if i < 7 else i + 1) % 2:
                assert recv_exact(sock, 8 + 1) == proto.blob(b"x")
                counts.append(struct.unpack("<q", recv_exact(sock, 8))[0])
        assert sorted(counts) == list(range(1, len(counts) + 1))
        for i, sock in enumerate(socks):  # nothing more, nothing twice: the next bytes answer a PING
            sock.sendall(proto.ping(i))
            assert recv_exact(sock, 4) == struct.pack("<I", i), f"waiter {i} got more than its replies"
        assert store.add("n", 0) == len(counts)
        store.close()
        for sock in socks:
            sock.close()
    finally:
        srv.stop()


# -- the service ------------------------------------------------------------------------------


@pytest.fixture
def service(tmp_path):
    """A `distlib store-server` process as deployments run it, logging at INFO to a file."""
    with StoreServerProcess(log_level="INFO", log_path=str(tmp_path / "store-server.log")) as server:
        yield server


def test_ping_health_check_and_sigterm(service):
    proc, port = service.proc, service.port
    result = subprocess.run(
        [sys.executable, "-m", "distlib.cli", "store-server", "--ping", f"127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "ok (distlib server" in result.stdout
    client = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=5))
    client.set("k", "v")
    client.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    log = service.log_text()
    assert "connected" in log and "disconnected" in log and "shutting down" in log
    result = subprocess.run(
        [sys.executable, "-m", "distlib.cli", "store-server", "--ping", f"127.0.0.1:{port}", "--timeout", "0.5"],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "not answering" in result.stderr and "connection refused" in result.stderr


def test_thousands_of_idle_connections(service):
    proc, port = service.proc, service.port
    wanted = 3000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted + 100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, wanted + 1000), hard))
    socks = []
    try:
        for _ in range(wanted):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(HELLO)
            socks.append(sock)
        for sock in socks[:: max(1, wanted // 50)]:
            assert recv_exact(sock, 4) == struct.pack("<I", 1234)
        store = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10))
        start = time.monotonic()
        store.set("busy", "no")
        assert store.get("busy") == b"no"
        assert time.monotonic() - start < 1.0
        store.close()
    finally:
        for sock in socks:
            sock.close()
    assert proc.poll() is None


def test_torch_client_sequence_is_served(service):
    """The exact request sequence of a torch client (from the spec's captures)."""
    port = service.port
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"\x00\xce\xf7\x85\x3c")
    sock.sendall(b"\x0d\x41\x63\x00\x00")
    assert recv_exact(sock, 4) == b"\x41\x63\x00\x00"
    sock.sendall(b"\x04" + proto.blob(b"init/") + struct.pack("<q", 1))
    assert struct.unpack("<q", recv_exact(sock, 8))[0] >= 1
    sock.sendall(bytes.fromhex("01 03 00 00 00 00 00 00 00 2f 6b 31 02 00 00 00 00 00 00 00 76 31"))
    sock.sendall(bytes.fromhex("06 01 00 00 00 00 00 00 00 03 00 00 00 00 00 00 00 2f 6b 31"))
    assert recv_exact(sock, 1) == b"\x00"
    sock.sendall(bytes.fromhex("03 03 00 00 00 00 00 00 00 2f 6b 31"))
    assert recv_exact(sock, 10) == bytes.fromhex("02 00 00 00 00 00 00 00 76 31")
    sock.sendall(bytes.fromhex("0f 02 00 00 00 00 00 00 00 2f 71"))  # QUEUE_POP on empty
    assert recv_exact(sock, 8) == b"\x00" * 8
    sock.sendall(b"\x12" + proto.blob(b"/bar") + struct.pack("<q", 1))  # BARRIER, world 1
    assert recv_exact(sock, 1) == b"\x00"
    sock.close()
