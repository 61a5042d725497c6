"""Where store servers listen: rank 0's (and the launcher's) on MASTER_ADDR's address only,
`distlib store-server` on loopback unless told --host; torch listens on every interface.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from distlib import net
from distlib.store.tcp import TCPStore
from distlib.store.tcp.security import StoreSecurity
from tests.fixtures.ports import free_port


def outward_address():
    """A non-loopback address of this host (the default route's), or None."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("198.51.100.1", 9))  # no packet is sent for a UDP connect
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_rank0_store_on_a_loopback_master_addr_is_not_reachable_from_other_interfaces():
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False,
                      security=StoreSecurity())
    try:
        listener = master._server.server.listener
        assert listener.getsockname()[0] == "127.0.0.1"
        other = outward_address()
        if other is not None:
            assert refused(other, master.port)
    finally:
        master.close()


def test_rank0_store_listens_on_the_interface_of_its_master_addr():
    address = outward_address()
    if address is None:
        pytest.skip("this host has no non-loopback address")
    master = TCPStore(address, 0, None, True, timedelta(seconds=10), wait_for_workers=False,
                      security=StoreSecurity())
    try:
        assert master._server.server.listener.getsockname()[0] == address
        assert master._server.server.local_listener is None  # not loopback: no same-host socket
        assert refused("127.0.0.1", master.port)
        worker = TCPStore(address, master.port, timeout=timedelta(seconds=10), security=StoreSecurity())
        worker.set("k", "v")
        assert master.get("k") == b"v"
        worker.close()
    finally:
        master.close()


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::"])
def test_a_wildcard_host_listens_everywhere(host):
    sock = net.bind_for_clients(host, 0)
    try:
        assert sock.getsockname()[0] in ("::", "0.0.0.0")
    finally:
        sock.close()


def test_an_address_that_is_not_this_hosts_listens_everywhere_with_a_warning(caplog):
    """A NAT or Service address: binding it is impossible, and torch's rule (every interface)
    is what makes the job work; said in a warning."""
    foreign = "203.0.113.77"
    try:
        socket.socket().bind((foreign, 0))
        pytest.skip(f"{foreign} is an address of this host")
    except OSError:
        pass
    caplog.set_level(logging.WARNING, "distlib.net")
    sock = net.bind_for_clients(foreign, 0)
    try:
        assert sock.getsockname()[0] in ("::", "0.0.0.0")
        assert any(f"'{foreign}' ({foreign}) is not an address of this host" in r.getMessage() for r in caplog.records)
    finally:
        sock.close()


def test_a_host_name_that_resolves_to_loopback_only_here_listens_everywhere(monkeypatch, caplog):
    """Debian's `127.0.1.1 <hostname>`: other hosts resolve the name to a real address."""
    monkeypatch.setattr(net, "_passive_addresses", lambda host, port: [(socket.AF_INET, "127.0.1.1")])
    caplog.set_level(logging.WARNING, "distlib.net")
    sock = net.bind_for_clients("node-a", 0)
    try:
        assert sock.getsockname()[0] in ("::", "0.0.0.0")
        assert any("resolves to 127.0.1.1 on this host (loopback), but other hosts know this one by that name"
                   in r.getMessage() for r in caplog.records)
    finally:
        sock.close()


def test_localhost_listens_on_loopback_only():
    sock = net.bind_for_clients("localhost", 0)
    try:
        assert sock.getsockname()[0] in ("127.0.0.1", "::1")
    finally:
        sock.close()


def test_a_taken_port_keeps_torchs_error_text():
    first = net.bind_for_clients("127.0.0.1", 0)
    try:
        with pytest.raises(Exception, match=r"^The server socket has failed to listen on any local network address"):
            net.bind_for_clients("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()


def test_store_server_listens_on_loopback_unless_told(tmp_path):
    port = free_port()
    log = open(tmp_path / "log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "distlib.cli", "store-server", "--port", str(port)], stderr=log)
    try:
        deadline = time.monotonic() + 20
        while "listening on" not in (tmp_path / "log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "listening on 127.0.0.1 (port" in (tmp_path / "log").read_text()
        other = outward_address()
        if other is not None:
            assert refused(other, port)
    finally:
        proc.terminate()
        proc.wait(10)
