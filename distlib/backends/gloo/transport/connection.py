"""A mesh's connections: how they are made, and what one of them holds.

Every rank listens, publishes ``host:port`` (and its host identity) in the group's store,
waits for everyone's, connects to every lower rank and accepts every higher one (accept.py
takes each arriving connection through its handshake, side by side with the others); a HELLO
frame names the connecting rank and the group, so a stray connection is refused. With a job
token (auth.py) every connection first runs the challenge-response, the acceptor speaking
first: a peer that cannot prove the token is refused before one byte of it is read as a frame
(object collectives unpickle what peers send), logged once per address (refusals.py), and
the mesh goes on waiting for the real peer.
"""

from __future__ import annotations

import ipaddress
import logging
import select
import socket
import struct
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

from .... import auth
from ....deadline import Deadline, format_duration
from ....errors import DistBackendError, DistNetworkError
from ....exposure import warn_open_listener
from ....net import classify, tune
from ....net import format_endpoint as endpoint
from ....refusals import RefusalLog
from . import frames
from .accept import Handshakes
from .frames import HELLO

#: The mesh's one logger (users filter on its name), shared by its modules.
log = logging.getLogger("distlib.transport.tcp")

SLICE = 0.5  # seconds one blocking socket call may take before deadlines are checked again
#: SO_RCVBUF of a connection between two ranks on one machine when that machine runs more of
#: the group's ranks than it has CPUs. See crowded_receive_buffer.
CROWDED_RCVBUF = 2048 << 10
#: How long an accepted connection has for each step of its handshake (the answer to the
#: token's challenge, its HELLO). A real peer answers in one round trip; connections are
#: handled side by side (accept.py), so a silent one holds up nobody but itself.
AUTH_REPLY_S = 5.0
_POLLIN = select.POLLIN | select.POLLPRI


def crowded_receive_buffer(ranks_here: int, cpus: int) -> int:
    """SO_RCVBUF for connections between ranks on this machine (0: the kernel's autotuning).

    Why: with more ranks than CPUs, the rank that is running sends ahead into the buffer
    of a neighbour that is not, and the kernel's autotuning lets that buffer grow to
    tcp_rmem's maximum (32 MiB here) per connection. Every queued byte is a kernel page that
    is written, waits, and is read back cold. A fixed 2 MiB (the kernel allocates twice
    that) keeps the in-flight data small: a 64 MiB all_reduce over TCP with 4 ranks on 2
    CPUs took 178 instead of 210 ms (median of 8 interleaved rounds), and 3 ranks 103
    instead of 125 ms. With a CPU per rank the cap only makes senders wait (2 ranks on 2
    CPUs: 80 instead of 63 ms), so it is not set then, nor for peers on other machines,
    where the buffer must cover the network's bandwidth-delay product.
    """
    return CROWDED_RCVBUF if ranks_here > cpus else 0


def _open_connection(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to ``host:port``. Peers advertise IP addresses, which need no name
    lookup: connecting directly skips getaddrinfo, whose first call in a process imports the
    IDNA codec (about 1 ms of CPU in every rank at init, all ranks at once)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host.split("%")[0]).version == 6 else socket.AF_INET
    except ValueError:
        return socket.create_connection((host, port), timeout=timeout)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class PeerConnection:
    """The connection to one peer; frames are read by whoever holds ``read_lock``."""

    def __init__(self, peer: int, sock: socket.socket, address: str):
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.address = address
        self.send_lock = threading.Lock()
        self.read_lock = threading.Lock()
        self.failed: Optional[DistBackendError] = None
        self.header = bytearray(frames.HEADER_SIZE)
        self.last_heard = time.monotonic()
        self.status = ""  # what the peer said it waits for (HEARTBEAT)
        self.status_time = 0.0
        self.leftover = b""  # the unsent tail of a heartbeat: goes out before any other frame
        self.poller = select.poll()
        self.poller.register(self.fd, _POLLIN)

    def name(self) -> str:
        return f"rank {self.peer} ({self.address})"


def peer_connection(peer: int, sock: socket.socket, address: str, rcvbuf: int = 0) -> PeerConnection:
    """The connection to rank ``peer`` over ``sock`` (handshake done), set up for the mesh.
    ``rcvbuf`` > 0 fixes its SO_RCVBUF (crowded_receive_buffer)."""
    # Blocking sockets with kernel timeouts: one recv_into(MSG_WAITALL) reads a whole
    # payload and one sendmsg sends a whole frame (no poll-and-retry per chunk), while
    # every call still returns within SLICE to check the deadline and the mesh state.
    sock.setblocking(True)
    if rcvbuf > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    timeval = struct.pack("ll", int(SLICE), int((SLICE % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    return PeerConnection(peer, sock, address)


class Connector:
    """Makes the connections of rank ``rank``'s mesh ``mesh_id`` (of ``size`` ranks, named
    ``label`` in errors), authenticated with ``token`` when there is one."""

    def __init__(self, rank: int, size: int, mesh_id: int, label: str, token: Optional[bytes]):
        self.rank = rank
        self.size = size
        self.mesh_id = mesh_id
        self.label = label
        self.token = token
        #: Connections refused, by address: logged once per interval with a count (refusals.py);
        #: their totals go into the timeout error
        self.refused = RefusalLog(log)

    def connect_all(self, listener: socket.socket, addresses: Sequence[Tuple[str, int]], deadline: Deadline,
                    rcvbuf: Sequence[int], add: Callable[[PeerConnection], None],
                    conns: List[Optional[PeerConnection]]) -> None:
        """Connect to every lower rank, accept every higher one on ``listener``, and ``add``
        each connection as it is made. ``rcvbuf[peer]``, where given and > 0, fixes that
        connection's SO_RCVBUF. On failure the connections made (``conns``) are closed."""
        warn_open_listener("this rank's gloo mesh", listener, self.token)  # once per process (exposure.py)
        hello = frames.pack(HELLO, 0, 0, 0, 0, 0, 0, frames.HELLO_PAYLOAD.size) + \
            frames.HELLO_PAYLOAD.pack(self.rank, self.mesh_id)
        for peer in range(self.rank):
            host, port = addresses[peer]
            sock = self._connect(peer, host, port, deadline)
            if self.token is not None:
                self._authenticate_to(peer, sock, host, port, deadline)
            sock.sendall(hello)
            add(peer_connection(peer, sock, endpoint(host, port), rcvbuf[peer] if peer < len(rcvbuf) else 0))
        expected = set(range(self.rank + 1, self.size))
        if expected:
            handshakes = Handshakes(listener, self.size, self.mesh_id, self.token, AUTH_REPLY_S,
                                    self._refused_connection, self._log_dropped)
            for peer, sock in handshakes.run(expected, deadline):
                expected.discard(peer)
                add(peer_connection(peer, sock, endpoint(addresses[peer][0], addresses[peer][1]),
                                    rcvbuf[peer] if peer < len(rcvbuf) else 0))
        self.refused.flush(final=True)  # the counts of refusals not logged yet: accepting is over
        if expected:
            for conn in conns:
                if conn is not None:
                    conn.sock.close()
            missing = ", ".join(f"{r} ({endpoint(*addresses[r][:2])})" for r in sorted(expected))
            raise DistNetworkError(
                f"{self.label}: rank {self.rank} waited {format_duration(deadline.seconds)} for ranks {missing} "
                f"to connect to {endpoint(*listener.getsockname()[:2])}; they published their addresses "
                f"but never connected (their host went down or the process died after joining, a firewall, "
                f"or this rank's advertised address is unreachable from them: set GLOO_SOCKET_IFNAME)"
                f"{self._refusals_text()}")

    def _connect(self, peer: int, host: str, port: int, deadline: Deadline) -> socket.socket:
        delay = 0.01
        last = "no attempt"
        while True:
            try:
                sock = _open_connection(host, port, max(0.01, min(5.0, deadline.remaining())))
                tune(sock)
                sock.settimeout(None)
                return sock
            except OSError as exc:
                last = classify(exc)
            if deadline.expired():
                raise DistNetworkError(
                    f"{self.label}: rank {self.rank} could not connect to rank {peer} at {endpoint(host, port)} "
                    f"within {format_duration(deadline.seconds)}: {last}. The address is the one rank {peer} "
                    f"advertised; if it is unreachable from here set GLOO_SOCKET_IFNAME on rank {peer}, "
                    f"and check firewalls (DISTLIB_PORT_RANGE confines the ports)")
            time.sleep(min(delay, deadline.remaining()))
            delay = min(0.5, delay * 2)

    def _authenticate_to(self, peer: int, sock: socket.socket, host: str, port: int, deadline: Deadline) -> None:
        """Prove the token to rank ``peer``'s listener, and make it prove it back."""
        where = f"rank {peer} at {endpoint(host, port)}"
        assert self.token is not None, "called only with a token"
        try:
            auth.connect_blocking(sock, self.token, deadline, where)
        except (auth.AuthError, OSError) as exc:
            sock.close()
            detail = str(exc) if isinstance(exc, auth.AuthError) else classify(exc)
            raise auth.AuthError(
                f"{self.label}: rank {self.rank} could not authenticate its mesh connection to {where}: {detail}. "
                f"Every rank of the job must have the same DISTLIB_AUTH_TOKEN (or DISTLIB_AUTH_TOKEN_FILE)") from None

    def _refused_connection(self, host: str, where: str, reason: str) -> None:
        """A connection failed authentication: logged once per address per interval, with a
        count (distlib/refusals.py), and remembered for the timeout error."""
        self.refused.refused(host, f"{self.label}: rank {self.rank} refused a mesh connection from {where}: {reason} "
                                   f"(this job's mesh requires authentication with DISTLIB_AUTH_TOKEN; nothing it sent "
                                   f"was read)", reason)

    def _log_dropped(self, message: str, *args) -> None:
        log.debug("%s: rank %d " + message, self.label, self.rank, *args)

    def _refusals_text(self) -> str:
        summary = self.refused.summary()
        return "; meanwhile it refused connections that failed authentication: " + summary if summary else ""
