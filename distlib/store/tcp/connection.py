"""One client connection of the store server, and the epoll events it is registered for.

Kept apart from the loop (server.py) so that every part of the server (reading and running,
admitting: intake.py, sending: sending.py) shares one definition of what a connection holds.
"""

from __future__ import annotations

import select
import socket
from typing import Deque, List, Optional

from . import admission
from .codec import ManyScan
from .state import Waiter

EPOLLIN = select.EPOLLIN
EPOLLOUT = select.EPOLLOUT
EPOLL_ERRS = select.EPOLLHUP | select.EPOLLERR
EPOLLIN_ERRS = EPOLLIN | EPOLL_ERRS
EPOLLRDHUP = getattr(select, "EPOLLRDHUP", 0x2000)
#: Connections are edge-triggered: the ready list then holds them in the order their data
#: arrived, and requests from different clients run in that order (level-triggered epoll
#: re-queues every reported fd behind the others, so a newer request could overtake an
#: older one; torch's servers keep arrival order, and code relies on it: a set() that has
#: returned is seen by a later request of another client).
CONN_EVENTS = EPOLLIN | EPOLLRDHUP | select.EPOLLET
#: A connection whose replies wait for the kernel: only told when it can take more (backpressure:
#: its requests stay in the kernel, and the loop needs no per-event check for it).
PAUSED_EVENTS = EPOLLOUT | select.EPOLLET
#: Buffers one sendmsg() takes at most (the kernel's IOV_MAX).
IOV_MAX = 1024


class Connection(Waiter):
    """Server-side state of one client connection (a Waiter of the state).

    Kept small, because the loop touches it once per request: the queues that most
    connections never need (``pending``, ``held``, ``inbuf``) are None until they do.
    """

    __slots__ = ("sock", "fd", "peer", "host", "inbuf", "need", "scan", "out", "refs", "pending",
                 "pending_own", "validated", "held", "is_worker", "paused", "tls", "gate", "buffered", "handshaking")

    def __init__(self, sock: socket.socket, peer: str, host: str = ""):
        super().__init__()
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.host = host or peer  # its address, without the port: what limits and the log count by
        self.inbuf: Optional[bytearray] = None  # the start of a request that has not fully arrived
        self.need = 0  # parse again once inbuf holds this many bytes (0: at once, it waited for output)
        self.scan: Optional[ManyScan] = None  # finds the end of a many-key request in inbuf
        self.out: List[bytes] = []  # replies produced this loop turn
        self.refs = False  # out carries a stored value by reference (handlers.py): sendmsg, no join
        self.pending: Optional[Deque[bytes]] = None  # replies the kernel did not take yet
        self.pending_own = 0  # of which the server's own bytes (not stored values; the budget's)
        self.validated = False
        self.held: Optional[Deque[bytes]] = None  # raw requests queued behind a wait
        self.is_worker = False  # sent ADD "init/"
        self.paused = False  # not read until its replies are out (backpressure)
        self.tls = False  # sock is a tls.TlsSocket
        self.gate: Optional[admission.Gate] = None  # on its way in (admission.py)
        self.buffered = 0  # bytes the server holds for it (the memory budget)
        self.handshaking = False  # its TLS handshake runs on the handshake thread (tls_handshakes.py)

