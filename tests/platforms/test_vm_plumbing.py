"""The VM plumbing's parts that need no VM (tests/support/vm.py, vm_kernel.py): the LAN
switch, the orphan sweep, the kernel unpacking. Fast; the VMs themselves are exercised by the
NFS tests beside this file."""

from __future__ import annotations

import lzma
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.support import vm
from tests.support.vm_kernel import extract


def _frame(dst: bytes, src: bytes, payload: bytes) -> bytes:
    frame = dst + src + b"\x08\x00" + payload
    return len(frame).to_bytes(4, "big") + frame


def _read_frame(sock: socket.socket) -> bytes:
    head = b""
    while len(head) < 4:
        head += sock.recv(4 - len(head))
    size = int.from_bytes(head, "big")
    body = b""
    while len(body) < size:
        body += sock.recv(size - len(body))
    return body


def test_the_switch_floods_unknown_destinations_then_learns():
    switch = vm.Switch()
    a_mac, b_mac, c_mac = (bytes([0x52, 0x54, 0, 0x4c, 0, i]) for i in (1, 2, 3))
    ports = [socket.create_connection(("127.0.0.1", switch.port)) for _ in range(3)]
    try:
        for p in ports:
            p.settimeout(5)
        deadline = time.monotonic() + 10
        while switch.connected() < 3:  # a port not accepted yet would miss the broadcast
            assert time.monotonic() < deadline, f"the switch accepted {switch.connected()} of 3 ports in 10 s"
            time.sleep(0.01)
        # a → broadcast: b and c get it
        ports[0].sendall(_frame(b"\xff" * 6, a_mac, b"hello all"))
        assert _read_frame(ports[1]).endswith(b"hello all") and _read_frame(ports[2]).endswith(b"hello all")
        # b answers a (learned from a's frame): only a gets it
        ports[1].sendall(_frame(a_mac, b_mac, b"to a"))
        assert _read_frame(ports[0]).endswith(b"to a")
        ports[2].settimeout(0.5)
        with pytest.raises(socket.timeout):
            _read_frame(ports[2])
        # two frames in one write, and one cut in two writes, arrive whole
        ports[2].sendall(_frame(a_mac, c_mac, b"one") + _frame(a_mac, c_mac, b"two")[:7])
        ports[2].sendall(_frame(a_mac, c_mac, b"two")[7:])
        assert _read_frame(ports[0]).endswith(b"one") and _read_frame(ports[0]).endswith(b"two")
    finally:
        for p in ports:
            p.close()
        switch.close()


def test_the_sweep_kills_a_dead_sessions_vm_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setattr(vm, "RUNS", tmp_path)
    code = "import time; time.sleep(120)"
    ours = subprocess.Popen([sys.executable, "-c", code, f"{vm.MARKER}:c9"], start_new_session=True)
    alive_owner = subprocess.Popen([sys.executable, "-c", code, f"{vm.MARKER}:c8"], start_new_session=True)
    stranger = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        (tmp_path / f"{ours.pid}.pid").write_text(f"{ours.pid} {dead.pid} c9\n")
        (tmp_path / f"{alive_owner.pid}.pid").write_text(f"{alive_owner.pid} {os.getpid()} c8\n")
        # a pidfile whose pid now belongs to a process that is not a VM of ours (pid reuse)
        (tmp_path / f"{stranger.pid}.pid").write_text(f"{stranger.pid} {dead.pid} c7\n")
        assert vm.sweep_orphans() == [f"c9 (pid {ours.pid})"]
        assert ours.wait(timeout=10) == -9
        assert alive_owner.poll() is None and stranger.poll() is None
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"{alive_owner.pid}.pid"]
    finally:
        for p in (ours, alive_owner, stranger):
            p.kill()
            p.wait()


def test_the_kernel_is_found_behind_a_decoy_magic():
    elf = b"\x7fELF" + os.urandom(2000)
    image = b"MZ" + b"\x00" * 100 + b"\xfd7zXZ\x00 not a stream" + b"\x00" * 50 + lzma.compress(elf) + b"\x00" * 64
    assert extract(image) == elf
    with pytest.raises(ValueError, match="no xz/gzip payload"):
        extract(b"MZ" + b"\x00" * 200)
