"""The c10d master service, from the agent's side: find it, host it when it is ours, and
hand out node ranks through it (``--node-rank auto``).

``--rdzv-backend c10d --rdzv-endpoint HOST:PORT`` means a ``distlib store-server`` runs at the
endpoint and every worker is its client. ``ensure_master_service`` checks that before any
worker starts, so a wrong endpoint fails in seconds with a message that names it, instead of
every worker timing out after the store timeout:

* the endpoint answers: use it;
* nothing answers, and HOST is this machine (a loopback address, or an address a socket here
  can bind): this agent starts a store server in-process, listening on the endpoint's address
  only (net.bind_for_clients: 127.0.0.1 stays on this machine; the node's own address is what
  other nodes reach), and keeps it up while its workers run — and, after they finished
  well, until the other clients (workers of other nodes) have disconnected, for at most the
  rendezvous timeout. Two agents on one machine may both try; the one whose bind fails uses
  the other's server;
* PORT is 0 (``--standalone``, or torchrun's ``--rdzv-endpoint localhost:0`` idiom): a server
  on a free port of this machine, for this single-node run only;
* otherwise: wait for the endpoint to answer, up to the rendezvous timeout (in a cluster the
  master service often starts a moment after the workers).
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Optional, Tuple

from ..deadline import Deadline, format_duration
from ..errors import DistError
from ..keyspace import KeySpace
from ..store.tcp.connect import format_endpoint
from .resolve import Resolved

log = logging.getLogger("distlib.launcher")

#: How long an agent gives a store server on this machine to answer before starting its own.
LOCAL_PROBE_S = 1.0
#: A client that gives up at its deadline returns a moment before our clock reads it: within
#: this much, the wait is what ran out (and the error says so).
RAN_OUT_SLACK_S = 0.05


class LauncherError(RuntimeError):
    """The launcher cannot go on (the message says what it waited for, and on whom)."""


class HostedStore:
    """A store server this agent runs in-process for its run."""

    def __init__(self, server, host: str):
        self.server = server
        self.host = host

    @property
    def port(self) -> int:
        return self.server.port

    def clients(self) -> int:
        return len(getattr(self.server, "conns", ()))

    def linger(self, seconds: float) -> None:
        """Keep serving until no client is connected, for at most ``seconds``."""
        deadline = Deadline(seconds)
        announced = False
        while self.clients() and not deadline.expired():
            if not announced:
                log.info("keeping the store server on port %d up until its %d remaining client(s) disconnect "
                         "(workers of other nodes; at most %s)", self.port, self.clients(),
                         format_duration(deadline.remaining()))
                announced = True
            time.sleep(min(0.1, deadline.remaining()))
        if self.clients():
            log.warning("stopping the store server on port %d with %d client(s) still connected: waited %s",
                        self.port, self.clients(), format_duration(deadline.elapsed()))

    def stop(self) -> None:
        self.server.stop()


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine: a loopback address, or one a socket here can bind."""
    try:
        infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _type, _proto, _name, addr in infos:
        ip = str(addr[0])  # an IP address (typeshed allows an int for other families)
        if ip.startswith("127.") or ip == "::1":
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((ip, 0))
            return True
        except OSError:
            continue
    return False


def _refused(host: str, port: int) -> bool:
    """One quick connect attempt: True when nobody listens (connection refused)."""
    try:
        with socket.create_connection((host, port), timeout=LOCAL_PROBE_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def check_answers(host: str, port: int, timeout: float) -> None:
    """Handshake and PING with a store server at host:port, retrying until ``timeout``."""
    from ..store.tcp.client import TCPStore

    store = TCPStore(host, port, None, False, timeout)
    try:
        store.ping()
    finally:
        store.close()


def _host(port: int, host: str) -> HostedStore:
    from ..net import bind_for_clients
    from ..store.tcp.server import StoreServer

    # Only where the workers reach it (the endpoint's address), with the job's token and TLS.
    server = StoreServer(listen_sock=bind_for_clients(host, port)).start(f"distlib-run-store:{port}")
    return HostedStore(server, host)


def ensure_master_service(host: str, port: int, timeout: float) -> Optional[HostedStore]:
    """Make sure a store server answers at host:port (module docstring); return it if we host it."""
    where = format_endpoint(host, port)
    local = is_local_host(host)
    if port == 0:
        if not local:
            raise LauncherError(
                f"rendezvous endpoint {where}: port 0 means 'a free port on this machine', but {host!r} is not "
                "this machine; give the master service's port")
        hosted = _host(0, host)
        log.info("started a store server for this run on port %d (endpoint port 0)", hosted.port)
        return hosted
    if local and _refused(host, port):
        try:
            hosted = _host(port, host)
        except DistError as exc:
            log.info("could not start a store server at %s (%s); using the one another process started", where, exc)
        else:
            log.info("no store server answered at %s: this agent hosts one in-process until its workers finish",
                     where)
            return hosted
    log.info("waiting for the master service (distlib store-server) at %s (up to %s)", where,
             format_duration(timeout))
    started = time.monotonic()
    try:
        check_answers(host, port, timeout)
    except DistError as exc:
        waited = time.monotonic() - started
        # the wait that ran out, or how soon the endpoint failed without running out of it
        if waited + RAN_OUT_SLACK_S >= timeout:
            what = f"no distlib store-server answered at {where} within {format_duration(timeout)}"
        else:
            what = (f"the master service at {where} failed after {format_duration(waited)} (of up to "
                    f"{format_duration(timeout)})")
        raise LauncherError(
            f"{what} (--rdzv-backend c10d --rdzv-endpoint {where}); start one there (distlib store-server --host "
            f"0.0.0.0 --port {port}) or fix the endpoint: {exc}") from exc
    return None


def serve(resolved: Resolved, timeout: float) -> Tuple[Optional[HostedStore], Resolved]:
    """The master service of a launch whose store is a TCP store at the resolved endpoint (c10d,
    and every elastic launch without a file endpoint): ``ensure_master_service`` there, and with
    endpoint port 0 the port the hosted server got, in the Resolved handed back. The one place a
    launcher hosts a store, for a fixed-size and an elastic launch alike."""
    host, port = str(resolved.master_addr.value), int(resolved.master_port.value)
    hosted = ensure_master_service(host, port, timeout)
    if hosted is not None and port == 0:
        resolved = resolved.with_master_port(hosted.port, "a free port (this agent hosts the store)")
    return hosted, resolved


def node_rank_key(run_id: str) -> str:
    """The counter ``--node-rank auto`` increments: inside the run's namespace of the master service."""
    return KeySpace(run_id).node_rank_counter()


def take_node_rank(host: str, port: int, run_id: str, nnodes: int, timeout: float) -> int:
    """``add(node_rank_key, 1) - 1`` on the master service: a node rank no other node of this run got."""
    from ..store.tcp.client import TCPStore

    where = format_endpoint(host, port)
    try:
        store = TCPStore(host, port, None, False, timeout)
        try:
            rank = store.add(node_rank_key(run_id), 1) - 1
        finally:
            store.close()
    except DistError as exc:
        raise LauncherError(f"--node-rank auto: could not take a node rank from the master service at {where}: "
                            f"{exc}") from exc
    if rank >= nnodes:
        raise LauncherError(
            f"--node-rank auto: the master service at {where} handed out node rank {rank}, but the run has "
            f"{nnodes} node(s) (ranks 0..{nnodes - 1}): more launchers than --nnodes joined run id {run_id!r}. "
            f"Either more replicas than --nnodes were started, or an earlier run used the same run id on this "
            f"master service (its counter is at {rank + 1}); give every run its own --run-id")
    return rank
