"""The store server's observer (distlib/store/tcp/observe.py): every request, from the peer
that sent it, with the keys it names, including requests held behind a wait; none of it
without an observer."""

import threading
from datetime import timedelta

from distlib import TCPStore
from distlib.store.tcp.server import StoreServer


def test_the_observer_hears_every_request_with_its_peer_and_keys():
    heard = []
    server = StoreServer("127.0.0.1", 0, observer=lambda peer, op, keys: heard.append((peer, op, keys)))
    assert server.batch is None  # every request through the observed table
    server.start()
    try:
        store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10))
        store.set("a", b"1")
        store.add("counter", 2)
        store.compare_set("a", b"1", b"2")
        store.multi_set(["m1", "m2"], [b"x", b"y"])
        waiter = threading.Thread(target=store.wait, args=(["late"],))
        waiter.start()
        TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10)).set("late", b"!")
        waiter.join(10)
        assert store.get("late") == b"!"  # a GET held behind the WAIT, heard when it ran
        store.close()
    finally:
        server.stop()
    # the keys as they travel and are stored: a TCPStore client puts "/" in front (torch's)
    ops = [(op, keys) for _, op, keys in heard]
    for expected in [("set", (b"/a",)), ("add", (b"/counter",)), ("compare_set", (b"/a",)),
                     ("multi_set", (b"/m1", b"/m2")), ("wait", (b"/late",)), ("set", (b"/late",)),
                     ("get", (b"/late",))]:
        assert expected in ops, (expected, ops)
    assert ops.index(("wait", (b"/late",))) < ops.index(("set", (b"/late",))) < ops.index(("get", (b"/late",)))
    # (a same-host client comes through the UNIX socket: "127.0.0.1:unix (pid N)")
    assert all(peer.startswith("127.0.0.1:") for peer, _, _ in heard), {peer for peer, _, _ in heard}


def test_without_an_observer_the_table_is_the_handlers_own():
    server = StoreServer("127.0.0.1", 0)
    try:
        assert not any(getattr(op, "__name__", "") == "observed" for op in server.engine._ops)
        assert server.batch is not None
    finally:
        server.close()
