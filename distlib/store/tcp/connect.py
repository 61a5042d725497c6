"""Connecting to a TCP peer that may not be there yet, with a deadline and a clear failure.

Workers often start before the master, and container DNS names often appear a moment after
the container: a refused connection or an unresolvable name at first is normal. So
``connect`` retries with backoff until its deadline, saying so at WARNING after WARN_AFTER_S
and every WARN_EVERY_S after that (what failed, where, how long is left: a rank never waits in
silence; a loopback address gets a hint, since in a container it is nobody else's), and when
it gives up it says what went wrong, classified (``distlib.net.classify``) as one of

* ``name not resolved``  — DNS has no address for the host (yet);
* ``connection refused`` — the host answered but nobody listens on the port;
* ``host unreachable``   — no route to the host (network down, container disconnected);
* ``no answer``          — packets went out and nothing came back (firewall, dead host),

with the addresses the name resolved to, the number of attempts and the time spent. The
message starts as torch's does (``The client socket has timed out after <ms>ms while trying
to connect to (<host>, <port>).``) so code matching torch's text keeps matching.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import socket
import threading
import time
from typing import List, Optional, Tuple

from ...deadline import Deadline, format_duration
from ...errors import DistNetworkError
from ...net import NAME_NOT_RESOLVED, classify, format_endpoint, lookup_name, tune

__all__ = ["connect", "resolve", "resolve_within", "describe_socket", "format_endpoint", "classify",
           "lookup_name", "tune", "NameLookupStalled", "loopback_hint"]

log = logging.getLogger("distlib.store.tcp.connect")

FIRST_RETRY_DELAY = 0.002  # s; a master that starts a moment late (ranks started together) is found at once
MAX_RETRY_DELAY = 1.0  # s; and one that takes minutes costs a probe a second
ATTEMPT_TIMEOUT = 5.0  # s; one SYN without an answer for this long counts as "no answer"
#: A store not reached after this long is worth a WARNING (ranks started together reach it
#: within milliseconds; seconds mean a master still starting, or an address that is wrong) ...
WARN_AFTER_S = 3.0
#: ... repeated this often while the connect keeps retrying, so a rank never waits silently.
WARN_EVERY_S = 15.0

NAME_LOOKUP_STALLED = "name lookup did not finish"


def resolve(host: str, port: int) -> List[Tuple]:
    """getaddrinfo for a stream socket, IPv4 and IPv6, duplicates removed, order kept."""
    infos = socket.getaddrinfo(lookup_name(host), port, 0, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    seen, out = set(), []
    for family, type_, proto, _, addr in infos:
        if addr[:2] not in seen:
            seen.add(addr[:2])
            out.append((family, type_, proto, addr))
    return out


class NameLookupStalled(socket.gaierror):
    """getaddrinfo did not return within the time left: the resolver (DNS server, NSS
    module) hangs. Raised instead of waiting on it, so a connect keeps its deadline."""


def resolve_within(host: str, port: int, seconds: float) -> List[Tuple]:
    """``resolve``, giving up after ``seconds``.

    Why: getaddrinfo has no timeout of its own, and a stalled resolver (a DNS server that
    drops queries, say) can block it for far longer than the caller's deadline. IP literals
    need no resolver and are resolved in place; names are looked up on a daemon thread that
    is abandoned (it ends when the resolver gives up) if it does not answer in time.
    """
    try:
        ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        pass
    else:
        return resolve(host, port)
    outcome: List = []
    done = threading.Event()

    def lookup() -> None:
        try:
            outcome.append(resolve(host, port))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome.append(exc)
        done.set()

    threading.Thread(target=lookup, name=f"distlib-resolve-{host}", daemon=True).start()
    if not done.wait(max(0.0, seconds)):
        raise NameLookupStalled(
            socket.EAI_AGAIN, f"{NAME_LOOKUP_STALLED} within {format_duration(max(0.0, seconds))}")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def connect(host: str, port: int, deadline: Deadline, what: str = "TCPStore server",
            quiet: bool = False) -> socket.socket:
    """Connect to ``host:port``, retrying until ``deadline``; raise DistNetworkError after.

    Returns a blocking, tuned socket (TCP_NODELAY, SO_KEEPALIVE). ``quiet``: log nothing
    while retrying (a reconnecting client says it once itself).
    """
    attempts = 0
    delay = FIRST_RETRY_DELAY
    warn_at = WARN_AFTER_S
    last_failure = "no attempt made"
    addresses: List[str] = []
    while True:
        attempts += 1
        try:
            candidates = resolve_within(host, port, max(0.05, deadline.remaining()))
        except NameLookupStalled as exc:
            last_failure = f"{NAME_NOT_RESOLVED} ({exc.strerror})"
            candidates = []
        except socket.gaierror as exc:
            last_failure = f"{NAME_NOT_RESOLVED} ({exc.strerror})"
            candidates = []
        else:
            addresses = [a[3][0] for a in candidates]
        for family, type_, proto, addr in candidates:
            sock = socket.socket(family, type_, proto)
            try:
                sock.settimeout(max(0.001, min(ATTEMPT_TIMEOUT, deadline.remaining())))
                sock.connect(addr)
            except OSError as exc:
                sock.close()
                last_failure = f"{classify(exc)} at {format_endpoint(addr[0], port)}{loopback_hint(addr[0])}"
                continue
            sock.settimeout(None)
            tune(sock)
            if attempts > 1 and not quiet:
                log.info("connected to %s %s after %d attempts (%s)", what,
                         format_endpoint(host, port), attempts, format_duration(deadline.elapsed()))
            return sock
        if deadline.expired():
            break
        if quiet:
            pass
        elif deadline.elapsed() >= warn_at:
            log.warning("cannot reach %s %s after %s: %s; retrying until the deadline (%s left)", what,
                        format_endpoint(host, port), format_duration(deadline.elapsed()), last_failure,
                        format_duration(deadline.remaining()))
            warn_at = deadline.elapsed() + WARN_EVERY_S
        elif attempts == 1:
            log.info("waiting for %s %s: %s; retrying until the deadline (%s left)", what,
                     format_endpoint(host, port), last_failure, format_duration(deadline.remaining()))
        time.sleep(min(deadline.remaining(), delay * random.uniform(0.75, 1.25)))
        delay = min(MAX_RETRY_DELAY, delay * 1.6)
    raise DistNetworkError(
        f"The client socket has timed out after {int(deadline.seconds * 1000)}ms while trying "
        f"to connect to ({host}, {port}). {what} {format_endpoint(host, port)} unreachable: "
        f"last error: {last_failure}; "
        + (f"{host!r} resolved to {', '.join(addresses)}; " if addresses else f"{host!r} never resolved; ")
        + f"{attempts} attempts over {format_duration(deadline.elapsed())}."
    )


def loopback_hint(address: str) -> str:
    """`` (this container's own loopback: is MASTER_ADDR right?)`` for a loopback address, else "".

    A loopback MASTER_ADDR is right only when every rank runs on this host; in a container (or
    on one of several hosts) it names a place where no other rank's store can be.
    """
    try:
        loopback = ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return ""
    if not loopback:
        return ""
    container = os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv") or \
        bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    return f" ({'this container' if container else 'this host'}'s own loopback: is MASTER_ADDR right?)"


def describe_socket(sock: Optional[socket.socket]) -> str:
    """``local -> remote`` of a connected socket, for reprs and logs."""
    if sock is None:
        return "closed"
    try:
        local = sock.getsockname()
        remote = sock.getpeername()
    except OSError:
        return "closed"
    if getattr(socket, "AF_UNIX", None) is not None and sock.family == socket.AF_UNIX:
        name = remote.decode("ascii", "replace").lstrip("\0") if isinstance(remote, bytes) else remote
        return f"same-host socket -> @{name}"
    return f"{format_endpoint(local[0], local[1])} -> {format_endpoint(remote[0], remote[1])}"
