"""TCPStore: the client's bytes on the wire, its handling of torch servers, connecting,
the master's wait for workers, multi-tenancy and failure reporting."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from distlib import DistError, DistNetworkError, DistStoreError
from distlib.store.tcp import TCPStore
from distlib.store.tcp import codec as proto
from distlib.store.tcp.incarnation import INCARNATION_KEY

from .append_order import TRIES, slow_thread_switches, stale_reads  # noqa: F401 - a fixture
from .scripted_server import ScriptedServer

PID = struct.pack("<I", os.getpid() & 0xFFFFFFFF)
HANDSHAKE = b"\x00\xce\xf7\x85\x3c" + b"\x0d" + PID + proto.keys_request(proto.Op.CHECK, [proto.ORDERED_WAIT_PROBE_KEY])
TORCH_SERVER_HELLO = PID + b"\x01"  # ping echo, then NOT_READY for the probe: a torch server
DISTLIB_SERVER_HELLO = PID + b"\x00"


def u64(n):
    return struct.pack("<Q", n)


def blob(b):
    return u64(len(b)) + b


#: A client that reconnects asks a distlib server's incarnation (incarnation.py) in its handshake.
ASK_INCARNATION = b"\x03" + u64(len(INCARNATION_KEY)) + INCARNATION_KEY
AN_INCARNATION = u64(16) + b"\x5a" * 16


def short(seconds=5.0):
    return timedelta(seconds=seconds)


# -- the bytes a client sends ------------------------------------------------------------------


def test_handshake_then_worker_counter_bytes():
    """VALIDATE (magic LE) and PING (pid) first, as torch; then ADD "init/" 1 (no slash)."""
    server = ScriptedServer([
        ("expect", HANDSHAKE), ("send", TORCH_SERVER_HELLO),
        ("expect", b"\x04" + blob(b"init/") + struct.pack("<q", 1)), ("send", struct.pack("<q", 1)),
    ])
    store = TCPStore("127.0.0.1", server.port, world_size=2, timeout=short())
    server.finish()
    assert store.ordered_waits is False
    store.close()


@pytest.mark.parametrize("store_timeout, wording", [
    (0.3, "within 1.0s (the reply deadline: 1.0s at least, longer than the store timeout of 300ms)"),
    (1.5, "within 1.5s (the store timeout)"),
])
def test_a_reply_that_never_comes_names_the_timeout_that_ran_out(monkeypatch, store_timeout, wording):
    """Issue 37: a reply that must come at once waits max(store timeout, MIN_REPLY_DEADLINE);
    the error said "(the store timeout)" with the reply deadline's figure, e.g. "within 30.0s
    (the store timeout)" for a store timeout of 3 s."""
    from distlib.store.tcp import client_channel

    monkeypatch.setattr(client_channel, "MIN_REPLY_DEADLINE", 1.0)
    server = ScriptedServer([
        ("expect", HANDSHAKE), ("send", DISTLIB_SERVER_HELLO),
        ("expect", b"\x04" + blob(b"/n") + struct.pack("<q", 1)), ("silence", 3.0),
    ])
    # (reconnect_timeout=0: the ADD as torch sends it, without the sequence header of a client
    # that reconnects; tests/store/test_reconnect.py has that one)
    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=store_timeout), reconnect_timeout=0)
    with pytest.raises(DistError) as info:
        store.add("n", 1)
    assert wording in str(info.value), str(info.value)
    store.close()
    server.finish()


def test_set_and_get_against_a_torch_server_use_torchs_sequence():
    """Against a torch server: SET, then get = WAIT ["/k1"] -> 00, GET "/k1" -> blob."""
    server = ScriptedServer([
        ("expect", HANDSHAKE), ("send", TORCH_SERVER_HELLO),
        ("expect", b"\x01" + blob(b"/k1") + blob(b"v1")),
        ("expect", b"\x06" + u64(1) + blob(b"/k1")), ("send", b"\x00"),
        ("expect", b"\x03" + blob(b"/k1")), ("send", blob(b"v1")),
    ])
    store = TCPStore("127.0.0.1", server.port, timeout=short())
    store.set("k1", "v1")
    assert store.get("k1") == b"v1"
    server.finish()


def test_get_against_a_distlib_server_is_one_round_trip():
    server = ScriptedServer([
        ("expect", HANDSHAKE), ("send", DISTLIB_SERVER_HELLO),
        ("expect", ASK_INCARNATION), ("send", AN_INCARNATION),
        ("expect", b"\x06" + u64(1) + blob(b"/k1") + b"\x03" + blob(b"/k1")),
        ("send", b"\x00" + blob(b"v1")),
    ])
    store = TCPStore("127.0.0.1", server.port, timeout=short())
    assert store.ordered_waits is True
    assert store.get("k1") == b"v1"
    server.finish()


def test_spurious_wake_of_a_libuv_server_is_not_taken_for_a_value():
    """libuv wakes a WAIT on a compare_set that changed nothing; the GET then answers b"".
    The client re-checks the key and keeps waiting instead of returning b""."""
    server = ScriptedServer([
        ("expect", HANDSHAKE), ("send", TORCH_SERVER_HELLO),
        ("expect", b"\x06" + u64(1) + blob(b"/k")), ("send", b"\x00"),
        ("expect", b"\x03" + blob(b"/k")), ("send", blob(b"")),
        ("expect", b"\x05" + u64(1) + blob(b"/k")), ("send", b"\x01"),  # CHECK: NOT_READY
        ("expect", b"\x06" + u64(1) + blob(b"/k")), ("send", b"\x00"),
        ("expect", b"\x03" + blob(b"/k")), ("send", blob(b"real")),
    ])
    store = TCPStore("127.0.0.1", server.port, timeout=short())
    assert store.get("k") == b"real"
    server.finish()


def test_wait_timeout_cancels_and_reports_wire_keys():
    server = ScriptedServer([
        ("expect", HANDSHAKE), ("send", TORCH_SERVER_HELLO),
        ("expect", b"\x06" + u64(2) + blob(b"/a") + blob(b"/b")),
        ("silence", 0.2),
        ("expect", b"\x0c"), ("send", b"\x01"),
    ])
    store = TCPStore("127.0.0.1", server.port, timeout=short())
    with pytest.raises(DistStoreError) as info:
        store.wait(["a", "b"], timedelta(seconds=0.3))
    server.finish()
    assert str(info.value).startswith("wait timeout after 300ms, keys: /a, /b")
    assert f"127.0.0.1:{server.port}" in str(info.value)


def test_cancel_race_wait_completed_just_before_cancel():
    """torch's two-byte race: 00 then 01 after CANCEL_WAIT means the wait did complete."""
    server = ScriptedServer([
        ("expect", HANDSHAKE), ("send", TORCH_SERVER_HELLO),
        ("expect", b"\x06" + u64(1) + blob(b"/k")),
        ("silence", 0.15),
        ("expect", b"\x0c"), ("send", b"\x00\x01"),
    ])
    store = TCPStore("127.0.0.1", server.port, timeout=short())
    store.wait(["k"], timedelta(seconds=0.2))
    server.finish()


def test_cancel_race_with_a_pipelined_get_returns_the_value():
    """On a distlib server the GET queued behind the WAIT answers between 00 and 01."""
    server = ScriptedServer([
        ("expect", HANDSHAKE), ("send", DISTLIB_SERVER_HELLO),
        ("expect", ASK_INCARNATION), ("send", AN_INCARNATION),
        ("expect", b"\x06" + u64(1) + blob(b"/k") + b"\x03" + blob(b"/k")),
        ("silence", 0.15),
        ("expect", b"\x0c"), ("send", b"\x00" + blob(b"just in time") + b"\x01"),
        ("expect", b"\x06" + u64(1) + blob(b"/k2") + b"\x03" + blob(b"/k2")),
        ("silence", 0.15),
        ("expect", b"\x0c"), ("send", b"\x01" + blob(b"")),
    ])
    store = TCPStore("127.0.0.1", server.port, timeout=short(0.2))
    assert store.get("k") == b"just in time"
    with pytest.raises(DistStoreError, match="/k2"):
        store.get("k2")
    server.finish()


def test_client_rejects_a_wrong_ping_echo():
    server = ScriptedServer([("expect", HANDSHAKE), ("send", b"\xff\xff\xff\xff\x01")])
    with pytest.raises(DistNetworkError, match="Ping failed"):
        TCPStore("127.0.0.1", server.port, timeout=short(0.5))
    server.finish()


# -- master and workers ------------------------------------------------------------------------


def test_world_size_zero_is_rejected():
    with pytest.raises(ValueError, match="TCPStore world size cannot be 0"):
        TCPStore("127.0.0.1", 0, 0, True)


def test_master_waits_for_workers_and_names_who_joined():
    start = time.monotonic()
    with pytest.raises(DistStoreError) as info:
        TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=1))
    assert 0.9 <= time.monotonic() - start < 3
    text = str(info.value)
    assert "Timed out after 1 seconds waiting for clients. 1/2 clients joined." in text
    assert "joined from: 127.0.0.1:" in text


def test_master_returns_when_all_workers_joined():
    box = {}

    def master():
        box["m"] = TCPStore("127.0.0.1", port, 3, True, short())

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    thread = threading.Thread(target=master)
    thread.start()
    workers = [TCPStore("127.0.0.1", port, 3, False, short()) for _ in range(2)]
    thread.join(10)
    assert "m" in box
    # the counter key has no slash: invisible to list_keys, counted by num_keys
    assert workers[0].num_keys() == 1 and workers[0].list_keys() == []
    for s in workers + [box["m"]]:
        s.close()


def test_a_handshake_that_timed_out_after_failed_attempts_names_the_timeout_and_the_failure():
    """A server that closes the first connection and leaves the second silent: the error names
    the client's timeout (1000ms), the attempts and why they failed, not only the silence of the
    last attempt in what was left of the timeout (which read "did not answer ... within 8ms: is
    another service on this port?" under issue 37's flood)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    held = []

    def serve():
        first, _ = listener.accept()
        first.close()  # a refusal
        second, _ = listener.accept()
        held.append(second)  # silent

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(DistNetworkError) as info:
            TCPStore("127.0.0.1", port, timeout=short(1.0))
        text = str(info.value)
        assert "timed out after 1000ms" in text and "connected 2 times, but the handshake failed" in text, text
        assert "Failed to recv" in text and "is another service" not in text, text
    finally:
        thread.join(5)
        listener.close()
        for sock in held:
            sock.close()


def test_worker_started_before_master_connects_when_it_appears():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    box = {}

    def worker():
        box["w"] = TCPStore("127.0.0.1", port, 2, False, short(10))
        box["w"].set("hello", "from worker")

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(0.7)
    master = TCPStore("127.0.0.1", port, 2, True, short(10))
    thread.join(10)
    assert master.get("hello") == b"from worker"
    master.close()
    box["w"].close()


def test_connection_refused_is_classified_with_time_and_address():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    start = time.monotonic()
    with pytest.raises(DistNetworkError) as info:
        TCPStore("127.0.0.1", port, timeout=timedelta(seconds=1))
    elapsed = time.monotonic() - start
    assert 0.9 <= elapsed < 3
    text = str(info.value)
    assert text.startswith(f"The client socket has timed out after 1000ms while trying to connect to (127.0.0.1, {port}).")
    assert "connection refused (nobody listening)" in text
    assert "resolved to 127.0.0.1" in text
    assert "attempts over" in text


def test_unresolvable_name_is_classified():
    with pytest.raises(DistNetworkError) as info:
        TCPStore("dnsnotexist.invalid", 23456, timeout=timedelta(seconds=1))
    text = str(info.value)
    assert "client socket has timed out after" in text and "dnsnotexist" in text
    assert "name not resolved" in text and "never resolved" in text


def test_stalled_name_lookup_does_not_outlive_the_timeout(monkeypatch):
    """A resolver that hangs (a DNS server dropping queries) must not hold the client past
    its timeout: the lookup is abandoned and the error says it stalled."""
    from distlib.store.tcp import connect as connect_mod

    real = connect_mod.socket.getaddrinfo
    release = threading.Event()

    def hanging(host, *args, **kwargs):
        if host in ("stalled.example", b"stalled.example"):  # resolve() passes ASCII names as bytes
            release.wait(30)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(connect_mod.socket, "getaddrinfo", hanging)
    start = time.monotonic()
    try:
        with pytest.raises(DistNetworkError) as info:
            TCPStore("stalled.example", 23456, timeout=timedelta(seconds=1))
    finally:
        release.set()
    assert time.monotonic() - start < 3
    text = str(info.value)
    assert "name not resolved (name lookup did not finish within" in text
    assert "'stalled.example' never resolved" in text


def test_connecting_by_ascii_name_skips_the_idna_codec():
    """A rank's first connect must not import the IDNA codec (about 3 ms of CPU inside every
    rank's init_process_group): ASCII names and IP literals go to getaddrinfo as bytes, with
    the same result; a non-ASCII name still goes through IDNA."""
    code = (
        "import sys, socket\n"
        "from datetime import timedelta\n"
        "from distlib.store.tcp import TCPStore\n"
        "from distlib.store.tcp.connect import lookup_name, resolve\n"
        "assert lookup_name('bücher.example') == 'bücher.example'\n"
        "assert lookup_name('localhost') == b'localhost'\n"
        "assert resolve('localhost', 7)[0][3][1] == 7\n"
        "master = TCPStore('127.0.0.1', 0, None, True, timedelta(seconds=5), wait_for_workers=False)\n"
        "worker = TCPStore('localhost', master.port, None, False, timedelta(seconds=5))\n"
        "worker.set('k', 'v'); assert master.get('k') == b'v'\n"
        "print('encodings.idna' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, DISTLIB_STORE_UNIX="0"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_server_gone_fails_every_later_call_naming_the_server():
    master = TCPStore("127.0.0.1", 0, None, True, short(), wait_for_workers=False)
    client = TCPStore("127.0.0.1", master.port, None, False, short())
    client.set("k", "v")
    master.close()
    time.sleep(0.2)
    for _ in range(2):
        with pytest.raises(DistNetworkError) as info:
            client.add("k2", 1)
        assert f"127.0.0.1:{master.port}" in str(info.value)
        assert "Connection was likely closed" in str(info.value) or "Failed to" in str(info.value)


def test_port_in_use_raises_torch_text():
    first = TCPStore("127.0.0.1", 0, None, True, short(), wait_for_workers=False)
    with pytest.raises(DistNetworkError, match="^The server socket has failed to listen on any local .*" + str(first.port)):
        TCPStore("127.0.0.1", first.port, None, True, short(), wait_for_workers=False)
    first.close()


def test_multi_tenant_masters_share_one_server():
    a = TCPStore("127.0.0.1", 0, 1, True, short(), multi_tenant=True)
    port = a.port
    b = TCPStore("127.0.0.1", port, 1, True, short(), multi_tenant=True)
    a.set("shared", "yes")
    assert b.get("shared") == b"yes"
    assert b.num_keys() == 2  # init/ (incremented by both) and /shared
    a.close()
    c = TCPStore("127.0.0.1", port, 1, True, short(), multi_tenant=True)
    assert c.get("shared") == b"yes"
    b.close()
    c.close()


def test_agent_store_tolerates_a_taken_port(monkeypatch):
    first = TCPStore("127.0.0.1", 0, None, True, short(), wait_for_workers=False)
    first.set("from_first", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", str(first.port))
    second = TCPStore("127.0.0.1", first.port, None, True, short(), wait_for_workers=False)
    assert "server=<nullptr>" in repr(second)
    assert second.get("from_first") == b"1"
    monkeypatch.setenv("MASTER_PORT", str(first.port + 1))
    with pytest.raises(DistNetworkError):
        TCPStore("127.0.0.1", first.port, None, True, short(), wait_for_workers=False)
    second.close()
    first.close()


def test_master_listen_fd_takes_over_a_bound_socket():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    store = TCPStore("127.0.0.1", port, 1, True, short(), master_listen_fd=sock.detach())
    assert store.port == port
    store.set("k", "v")
    assert store.get("k") == b"v"
    store.close()


def test_port_zero_reports_the_real_port_and_repr():
    store = TCPStore("127.0.0.1", 0, None, True, short(), wait_for_workers=False)
    assert store.port > 0 and store.host == "127.0.0.1"
    assert f"server=TCPServer(port={store.port})" in repr(store)
    clone = store.clone()
    assert "server=<nullptr>" in repr(clone)
    assert clone.timeout == store.timeout
    clone.close()
    store.close()


def test_ipv6_loopback_and_localhost():
    store = TCPStore("::1", 0, None, True, short(), wait_for_workers=False)
    store.set("v6", "1")
    other = TCPStore("localhost", store.port, None, False, short())
    assert other.get("v6") == b"1"
    other.close()
    store.close()


def test_legacy_flag_refuses_queues_locally():
    store = TCPStore("127.0.0.1", 0, None, True, short(), wait_for_workers=False, use_libuv=False)
    assert store.libuvBackend is False
    with pytest.raises(NotImplementedError, match="queues not implemented on legacy TCPStore backend"):
        store.queue_push("q", "1")
    store.close()


def test_oversized_key_and_value_are_refused_before_sending():
    store = TCPStore("127.0.0.1", 0, None, True, short(), wait_for_workers=False)
    with pytest.raises(ValueError, match="key of 9000 bytes"):
        store.set("k" * 8999, "v")
    with pytest.raises(ValueError, match="exceeds the limit"):
        store.set("big", b"x" * (proto.MAX_VALUE_BYTES + 1))
    store.set("still", "usable")
    assert store.get("still") == b"usable"
    store.close()


def test_add_on_non_numeric_value_closes_only_that_connection():
    master = TCPStore("127.0.0.1", 0, None, True, short(), wait_for_workers=False)
    bad = master.clone()
    master.set("text", "abc")
    assert master.get("text") == b"abc"  # the set has reached the server
    with pytest.raises(DistNetworkError):
        bad.add("text", 1)
    assert master.get("text") == b"abc"
    bad.close()
    master.close()


# -- server semantics that differ from torch's servers, on purpose -----------------------------


def test_compare_set_that_changes_nothing_does_not_wake_a_get():
    master = TCPStore("127.0.0.1", 0, None, True, short(), wait_for_workers=False)
    getter, other = master.clone(), master.clone()
    box = {}

    def run():
        box["value"] = getter.get("never_set_yet")

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.2)
    assert other.compare_set("never_set_yet", "x", "y") == b"x"
    time.sleep(0.2)
    assert thread.is_alive() and "value" not in box
    other.set("never_set_yet", "real")
    thread.join(5)
    assert box["value"] == b"real"


def test_compare_set_that_creates_the_key_wakes_waiters():
    master = TCPStore("127.0.0.1", 0, None, True, short(), wait_for_workers=False)
    getter = master.clone()
    def create_later():
        time.sleep(0.2)
        master.compare_set("cs_new", "", "made")

    thread = threading.Thread(target=create_later)
    thread.start()
    assert getter.get("cs_new") == b"made"
    thread.join(5)


@pytest.mark.usefixtures("slow_thread_switches")
def test_master_handle_reads_after_another_processs_append():
    """The master handle sets a key, a client in another process appends to it (no reply),
    the master reads it: the get must not overtake the APPEND the server had already
    received (append_order.py; test_tcp_store_interop.py runs it with a torch client). The
    master's server runs on a thread of this process, so the master confirms its SET with a
    PING before its next request. Without that it read the old value in 0 to 12 of 40 tries
    (in 5 runs of 6; torch's faster client makes it 38 of 40), hence more tries here."""
    master = TCPStore("127.0.0.1", 0, None, True, short(30), wait_for_workers=False)
    tries = 2 * TRIES
    try:
        stale = stale_reads(master, "distlib", tries)
    finally:
        master.close()
    assert stale == [], f"the master read {len(stale)} of {tries} keys without the other client's append: {stale}"


def test_an_in_process_client_confirms_what_it_sent_without_reply():
    """Each kind of request without reply (set, append, multi_set, queue_push, and a value
    over the size sent in one write) is confirmed before the next request of a client of an
    in-process server; a client of a server in another process sends torch's bytes only
    (the scripted-server tests above pin those)."""
    master = TCPStore("127.0.0.1", 0, None, True, short(), wait_for_workers=False)
    clone = master.clone()
    try:
        big = os.urandom(200_000)
        master.set("k", "v")
        master.append("k", "w")
        master.multi_set(["m1", "m2"], ["1", "2"])
        master.queue_push("q", "x")
        master.set("big", big)
        clone.set("from_clone", "c")
        assert master.get("k") == b"vw"
        assert master.multi_get(["m1", "m2", "big", "from_clone"]) == [b"1", b"2", big, b"c"]
        assert clone.queue_pop("q") == b"x"
        assert master.num_keys() == 5  # k, m1, m2, big, from_clone (the queue is empty)
        master.set("last", "1")
        assert 0 <= master.ping() < 30  # the PING's own echo, after the confirmation's
    finally:
        clone.close()
        master.close()
