"""The same-host socket between users: an abstract UNIX socket name has no permissions, so
each end checks the other's user (SO_PEERCRED) and a name someone else took is a warning.

The other user is a child process that drops to uid 65534 ("nobody"): these tests need root.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest

from distlib.net import unix_socket_name
from distlib.store.tcp import StoreServer, TCPStore
from distlib.store.tcp.security import StoreSecurity
from tests.fixtures.ports import free_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")

NOBODY = 65534

SQUATTER = textwrap.dedent("""
    import os, socket, sys
    os.setgid({uid}); os.setuid({uid})
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind({name!r})
    s.listen(16)
    print("ready", flush=True)
    s.settimeout(float(sys.argv[1]))
    got = 0
    try:
        while True:
            c, _ = s.accept()
            c.settimeout(1)
            try:
                while True:
                    data = c.recv(4096)
                    if not data:
                        break
                    got += len(data)
            except OSError:
                pass
    except OSError:
        pass
    print("received", got, flush=True)
""")

INTRUDER = textwrap.dedent("""
    import os, socket
    os.setgid({uid}); os.setuid({uid})
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect({name!r})
    s.settimeout(5)
    try:
        s.sendall(bytes.fromhex("00cef7853c") + bytes.fromhex("0d01000000"))
        print("answer", s.recv(16).hex(), flush=True)
    except OSError as exc:
        print("error", exc, flush=True)
""")


def test_a_name_another_user_took_is_a_warning_and_clients_do_not_talk_to_it(caplog):
    caplog.set_level(logging.WARNING)
    port = free_port()
    squatter = subprocess.Popen([sys.executable, "-c", SQUATTER.format(uid=NOBODY, name=unix_socket_name(port)), "4"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "ready"
        server = StoreServer("127.0.0.1", port, security=StoreSecurity()).start()
        try:
            assert server.local_listener is None
            assert any(f"cannot listen on the same-host socket @distlib-store/tcp-port/{port}: another process holds "
                       f"the name" in r.getMessage() for r in caplog.records), caplog.text
            store = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=5), security=StoreSecurity())
            assert store.transport == "tcp"
            store.set("secret", "value")
            assert store.get("secret") == b"value"
            store.close()
            assert any(f"is held by process {squatter.pid} of uid {NOBODY}" in r.getMessage() and "not using it"
                       in r.getMessage() for r in caplog.records), caplog.text
        finally:
            server.stop()
        out, _ = squatter.communicate(timeout=20)
        assert "received 0" in out  # the client connected, saw the owner, and sent nothing
    finally:
        if squatter.poll() is None:
            squatter.kill()
            squatter.wait(10)


def test_the_server_refuses_a_same_host_client_of_another_user(caplog):
    caplog.set_level(logging.WARNING, "distlib.store.tcp.server")
    server = StoreServer("127.0.0.1", 0, security=StoreSecurity()).start()
    try:
        assert server.local_listener is not None
        result = subprocess.run(
            [sys.executable, "-c", INTRUDER.format(uid=NOBODY, name=unix_socket_name(server.port))],
            capture_output=True, text=True, timeout=30)
        assert result.stdout.startswith("answer \n") or result.stdout.startswith("error"), result.stdout
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any("refused same-host client 127.0.0.1:unix (pid" in r.getMessage()
                   and f"of uid {NOBODY}, not of this process's uid 0" in r.getMessage() for r in caplog.records), caplog.text
        store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=5), security=StoreSecurity())
        assert store.transport == "unix"  # this user's clients still use it
        store.close()
    finally:
        server.stop()
