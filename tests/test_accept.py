"""distlib/backends/gloo/transport/accept.py: a mesh listener's side of the handshake (the token's
challenge-response, then HELLO), against a real peer on a real TCP connection."""

import socket
import threading

import pytest

from distlib import auth
from distlib.deadline import Deadline
from distlib.backends.gloo.transport import frames
from distlib.backends.gloo.transport.accept import Handshakes

TOKEN = b"k" * 16
OTHER = b"j" * 16
MESH_ID = 7


class Listener:
    """Handshakes.run on a loopback listener in a thread, expecting rank 1 of 2; what it
    accepted and refused."""

    def __init__(self, token, deadline_s):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.refused = []
        self.accepted = []
        handshakes = Handshakes(self.sock, 2, MESH_ID, token, 5.0,
                                lambda host, where, reason: self.refused.append((where, reason)), lambda *a: None)
        self.thread = threading.Thread(
            target=lambda: self.accepted.extend(handshakes.run({1}, Deadline(deadline_s))), daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join(10)
        self.sock.close()


def hello(rank):
    return frames.pack(frames.HELLO, 0, 0, 0, 0, 0, 0, frames.HELLO_PAYLOAD.size) + \
        frames.HELLO_PAYLOAD.pack(rank, MESH_ID)


def test_the_exchange_succeeds_with_the_same_token():
    listener = Listener(TOKEN, 5)
    peer = socket.create_connection(("127.0.0.1", listener.port))
    auth.connect_blocking(peer, TOKEN, Deadline(5), "listener 127.0.0.1:2")
    peer.sendall(hello(1) + b"after")
    listener.join()
    assert [rank for rank, _ in listener.accepted] == [1] and listener.refused == []
    # the connection is usable after the handshake, nothing of what follows it consumed
    accepted = listener.accepted[0][1]
    assert accepted.recv(16) == b"after"
    accepted.close()
    peer.close()


def test_a_wrong_token_fails_on_both_sides_naming_the_cause():
    listener = Listener(TOKEN, 1)
    peer = socket.create_connection(("127.0.0.1", listener.port))
    with pytest.raises(auth.AuthError, match=r"authentication to listener 127.0.0.1:2 failed: wrong token"):
        auth.connect_blocking(peer, OTHER, Deadline(5), "listener 127.0.0.1:2")
    listener.join()
    where = f"127.0.0.1:{peer.getsockname()[1]}"
    assert listener.accepted == []
    assert len(listener.refused) == 1 and listener.refused[0][0] == where
    assert "failed authentication" in listener.refused[0][1], listener.refused
    peer.close()


def test_a_peer_that_closes_mid_response_is_named():
    listener = Listener(TOKEN, 1)
    peer = socket.create_connection(("127.0.0.1", listener.port))
    peer.recv(auth.CHALLENGE_BYTES)
    peer.sendall(b"\x00" * 10)
    peer.close()
    listener.join()
    assert listener.accepted == [] and len(listener.refused) == 1
    reason = listener.refused[0][1]
    assert "closed the connection" in reason and "(10 of the 64 bytes of its authentication response" in reason


def test_without_a_token_the_hello_alone_admits_the_peer_and_a_stranger_is_dropped():
    listener = Listener(None, 2)
    stranger = socket.create_connection(("127.0.0.1", listener.port))
    stranger.sendall(frames.pack(frames.HELLO, 0, 0, 0, 0, 0, 0, frames.HELLO_PAYLOAD.size) +
                     frames.HELLO_PAYLOAD.pack(1, MESH_ID + 1))  # another group's mesh
    peer = socket.create_connection(("127.0.0.1", listener.port))
    peer.sendall(hello(1))
    listener.join()
    assert [rank for rank, _ in listener.accepted] == [1]
    assert stranger.recv(16) == b""  # closed, and nothing was sent to it
    for _, sock in listener.accepted:
        sock.close()
    peer.close()
    stranger.close()
