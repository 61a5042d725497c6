"""The TCPStore servers that run on a thread of this process, and who owns them.

``TCPStore(is_master=True)`` starts a ``StoreServer`` on a daemon thread, as torch starts its
server thread. This module starts it (binding as torch binds, or taking over
``master_listen_fd``), keeps torch's ``multi_tenant=True`` rule — one server per port within a
process, shared by the masters that ask for it and stopped when the last of them is gone —
and knows which ports such a server serves, so that a client of this process can tell that
its server shares its interpreter (client.py: such a client confirms its unanswered requests,
see ``TCPStore`` "in-process clients").

Kept apart from client.py because it is a different job: the client speaks the protocol, this
module owns server threads.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Dict, Optional

from ...deadline import Deadline
from ...errors import DistNetworkError, DistStoreError
from ...net import bind_for_clients
from .security import StoreSecurity
from .server import StoreServer

log = logging.getLogger("distlib.store.tcp.in_process")


class InProcessServer:
    """A running in-process server and how many TCPStore objects own it.

    torch's ``multi_tenant=True`` shares one server per port within a process; the server
    stops when the last TCPStore that owns it is gone (``release``).
    """

    def __init__(self, server: StoreServer, multi_tenant: bool):
        self.server = server
        self.multi_tenant = multi_tenant
        self.owners = 0
        self.lock = threading.Lock()

    def wait_for_workers(self, world_size: int, deadline: Deadline) -> None:
        """The master's wait for ``world_size`` clients (wait_for_workers=True): the error names
        the peers that joined, since the missing ones never connected."""
        server = self.server
        server.wait_for_workers(world_size, deadline)
        if server.workers_joined >= world_size:
            return
        peers = ", ".join(server.worker_peers) or "nobody"
        raise DistStoreError(
            f"Timed out after {int(round(deadline.elapsed()))} seconds waiting for clients. "
            f"{server.workers_joined}/{world_size} clients joined. "
            f"(TCPStore master on port {server.port}; joined from: {peers}. The missing clients never "
            f"connected: check that they were started with this host and port and can reach it.)"
        )

    def acquire(self) -> None:
        with self.lock:
            self.owners += 1

    def release(self) -> None:
        """One owner is gone; the last one stops the server and forgets its port."""
        with self.lock:
            self.owners -= 1
            last = self.owners == 0
        if last:
            with _LOCK:
                if _TENANTS.get(self.server.port) is self:
                    del _TENANTS[self.server.port]
                if _RUNNING.get(self.server.port) is self:
                    del _RUNNING[self.server.port]
            self.server.stop()


#: multi_tenant servers by port: the ones a later multi_tenant master on that port joins.
_TENANTS: Dict[int, InProcessServer] = {}
#: every in-process server by port (serves_here).
_RUNNING: Dict[int, InProcessServer] = {}
_LOCK = threading.Lock()


def serves_here(port: int) -> bool:
    """True when a server on a thread of this process listens on ``port``.

    A client that connects to such a port most likely talks to that server (another host's
    server on the same port number is possible; treating it as in-process costs only the
    confirmations client.py then sends).
    """
    handle = _RUNNING.get(port)
    return handle is not None and handle.server.running


def agent_store_tolerates_bind_failure(port: int) -> bool:
    """torch's rule: a master whose bind fails becomes a plain client when
    TORCHELASTIC_USE_AGENT_STORE is truthy and MASTER_PORT names this port."""
    flag = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower()
    return flag in ("1", "true", "yes") and os.environ.get("MASTER_PORT", "").strip() == str(port)


def start_server(host: str, port: int, multi_tenant: bool, master_listen_fd: Optional[int],
                 security: StoreSecurity) -> Optional[InProcessServer]:
    """The master's server, owned once more by the caller: on ``host``'s address only
    (net.bind_for_clients; torch listens on every interface), with the job's security settings.

    Returns:
        the server's handle (``release()`` it when done), an already running multi_tenant
        server's handle for ``port``, or None when the port is taken and
        ``agent_store_tolerates_bind_failure`` says to use the server already there.
    Raises:
        DistNetworkError: the port cannot be bound, or ``master_listen_fd`` is bound to another
            port.
    """
    if multi_tenant and port != 0:
        with _LOCK:
            handle = _TENANTS.get(port)
            if handle is not None and handle.server.running:
                handle.acquire()
                return handle
    if master_listen_fd is not None:
        sock = socket.socket(fileno=int(master_listen_fd))
        bound = sock.getsockname()[1]
        if port and bound != port:
            raise DistNetworkError(f"master_listen_fd {master_listen_fd} is bound to port {bound}, not to port {port}")
        sock.listen(4096)
    else:
        try:
            sock = bind_for_clients(host, port)
        except DistNetworkError:
            if agent_store_tolerates_bind_failure(port):
                log.info("port %d is taken and TORCHELASTIC_USE_AGENT_STORE is set: using the server already there", port)
                return None
            raise
    server = StoreServer(listen_sock=sock, security=security)
    handle = InProcessServer(server.start(f"distlib-store-server:{sock.getsockname()[1]}"), multi_tenant)
    handle.acquire()
    with _LOCK:
        _RUNNING[handle.server.port] = handle
        if multi_tenant:
            _TENANTS[handle.server.port] = handle
    return handle
