"""Socket helpers that the store (client and server) and the collectives' mesh share.

Why a module of its own: the TCP store and gloo's mesh (``distlib/backends/gloo/transport``) both bind,
connect, tune and name sockets, and the transport must not import the store. Everything
here is a plain function of its arguments and the kernel: no state, no threads, no settings.

* ``format_endpoint`` / ``format_peer`` — ``host:port`` as errors and logs print it
  (``[v6]:port`` for IPv6, IPv4-mapped addresses shown as IPv4).
* ``lookup_name`` — a host name as getaddrinfo should get it (skips the IDNA import).
* ``classify`` — one connect attempt's failure in a user's words.
* ``tune`` — the options every store and mesh connection wants.
* ``bind_listener`` — torch's listening rule: dual-stack wildcard, torch's error text.
* ``bind_for_clients`` — listen only where clients that know this host by a name reach it.
* ``unix_socket_name`` / ``bind_local_listener`` / ``serves_loopback`` / ``unix_peer`` /
  ``same_user`` — the same-host abstract UNIX socket beside a TCP listener, and the check
  that its peer runs as this process's user.
* ``raise_fd_limit`` — RLIMIT_NOFILE's soft limit up to the hard limit (thousands of
  connections cost a descriptor each).
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import struct
import sys
from typing import List, Optional, Tuple

from .errors import DistNetworkError

log = logging.getLogger("distlib.net")

#: Listening backlog; the kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 4096

NAME_NOT_RESOLVED = "name not resolved"
CONNECTION_REFUSED = "connection refused (nobody listening)"
HOST_UNREACHABLE = "host unreachable"
NO_ANSWER = "no answer (timed out)"

_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def format_peer(addr) -> str:
    """A socket address (as accept() returns it) as ``host:port``; ``::ffff:a.b.c.d`` as IPv4."""
    host = addr[0]
    if host.startswith("::ffff:"):
        host = host[7:]
    return format_endpoint(host, addr[1])


def peer_host(addr) -> str:
    """The address part of a socket address (as accept() returns it), ``::ffff:a.b.c.d`` as
    IPv4: what a listener counts and logs a peer's connections by."""
    host = addr[0]
    return host[7:] if host.startswith("::ffff:") else host


def lookup_name(host: str):
    """``host`` as getaddrinfo should get it: bytes when it is ASCII (every IP literal and
    almost every host name), else the str itself.

    Why: given a str, getaddrinfo encodes it with the IDNA codec, and the first use of that
    codec in a process imports it (encodings.idna, stringprep, unicodedata: about 3 ms of
    CPU, paid by every rank inside init_process_group). For ASCII names the codec changes
    nothing, so bytes give the same lookup without the import.
    """
    return host.encode("ascii") if host.isascii() else host


def classify(exc: BaseException) -> str:
    """Name the failure of one connect attempt in a user's words."""
    if isinstance(exc, socket.gaierror):
        return NAME_NOT_RESOLVED
    if isinstance(exc, ConnectionRefusedError):
        return CONNECTION_REFUSED
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return NO_ANSWER
    if isinstance(exc, OSError) and exc.errno in _UNREACHABLE:
        return HOST_UNREACHABLE
    return f"{type(exc).__name__}: {exc}"


def tune(sock: socket.socket) -> None:
    """Options every store and mesh connection wants: no Nagle delay on small requests,
    keepalive so a peer that vanished is noticed during long waits."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def bind_listener(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """Bind and listen on every interface: an IPv6 dual-stack socket, else IPv4.

    Like torch, the ``host`` argument names where clients find the server; the server
    itself listens on all interfaces (``host`` "" or "0.0.0.0" or "::" for the wildcard, or
    a specific address to restrict it). Raises DistNetworkError with torch's text when the
    port is taken.
    """
    wildcard = host in WILDCARD_HOSTS
    attempts: List[Tuple[int, str]] = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")] if wildcard else []
    if not wildcard:
        try:
            attempts = _passive_addresses(host, port)
        except socket.gaierror as exc:
            raise DistNetworkError(f"The server socket cannot bind: host {host!r} does not resolve ({exc})") from exc
    errors: List[str] = []
    for family, addr in attempts:
        try:
            return _bind_one(family, addr, port, backlog)
        except OSError as exc:
            errors.append(f"bind to {format_peer((addr, port))} failed (errno {exc.errno}: {exc.strerror})")
    raise _bind_error(port, errors)


#: ``host`` values that mean "every interface".
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "*")


def _passive_addresses(host: str, port: int) -> List[Tuple[int, str]]:
    infos = socket.getaddrinfo(lookup_name(host), port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    seen: set = set()
    out: List[Tuple[int, str]] = []
    for info in infos:
        if info[4][0] not in seen:
            seen.add(info[4][0])
            out.append((info[0], str(info[4][0])))  # an IP address: str already (typeshed allows int)
    return out


def _bind_one(family: int, addr: str, port: int, backlog: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and addr == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((addr, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _bind_error(port: int, errors: List[str]) -> DistNetworkError:
    return DistNetworkError(
        "The server socket has failed to listen on any local network address. "
        f"port: {port}: " + "; ".join(errors)
        + (" — another process (or an earlier run) is using this port; pick another port or stop it"
           if any("errno 98" in e for e in errors) else "")
    )


def bind_for_clients(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """Listen only on the address through which clients reach this host as ``host`` (the job's
    MASTER_ADDR), not on every interface as torch does.

    Why: a store listening everywhere can be reached from networks the job never uses; with
    MASTER_ADDR=127.0.0.1 nothing off the host should reach it at all. The rule:

    * a wildcard ``host`` ("", 0.0.0.0, ::): every interface (asked for);
    * an address, or a name, that is an address of this host: that address (the first one
      that binds, in the resolver's order, which is the order clients try them in);
    * a name that resolves here only to loopback but is not ``localhost`` (Debian's
      ``127.0.1.1 <hostname>``): other hosts resolve it to a real address, so every interface,
      with a warning;
    * an address that is not this host's (behind NAT, a Kubernetes Service address, or a name
      that does not resolve here): every interface, with a warning.

    DistNetworkError with torch's text when the port is taken.
    """
    if host in WILDCARD_HOSTS:
        return bind_listener("", port, backlog)
    try:
        addresses = _passive_addresses(host, port)
    except socket.gaierror as exc:
        log.warning("the store's host %r does not resolve on this host (%s): listening on every interface",
                    host, exc.strerror)
        return bind_listener("", port, backlog)
    loopback = all(_is_loopback_address(a) for _, a in addresses)
    if loopback and not _is_ip_literal(host) and host.lower() != "localhost":
        log.warning("the store's host %r resolves to %s on this host (loopback), but other hosts know this one by "
                    "that name: listening on every interface", host, ", ".join(a for _, a in addresses))
        return bind_listener("", port, backlog)
    errors: List[str] = []
    for family, addr in addresses:
        try:
            return _bind_one(family, addr, port, backlog)
        except OSError as exc:
            if exc.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                raise _bind_error(port, [f"bind to {format_peer((addr, port))} failed "
                                         f"(errno {exc.errno}: {exc.strerror})"]) from None
            errors.append(addr)
    log.warning("the store's host %r (%s) is not an address of this host (NAT, a Service address?): listening on "
                "every interface", host, ", ".join(errors))
    return bind_listener("", port, backlog)


def _is_ip_literal(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host.strip("[]").split("%")[0])
    except OSError:
        return False
    return True


def _is_loopback_address(address: str) -> bool:
    if address.startswith("::ffff:"):
        address = address[7:]
    return address.startswith("127.") or address == "::1"


def unix_socket_name(port: int) -> bytes:
    """The abstract UNIX socket a distlib store server listening on TCP ``port`` (wildcard
    or loopback) also listens on, for distlib clients on the same host."""
    return b"\0distlib-store/tcp-port/%d" % port


def serves_loopback(listener: socket.socket) -> bool:
    """Whether clients on this host reach ``listener`` through a loopback address."""
    try:
        address = listener.getsockname()[0]
    except OSError:
        return False
    if address.startswith("::ffff:"):
        address = address[7:]
    return address in ("", "0.0.0.0", "::") or address.startswith("127.") or address == "::1"


def bind_local_listener(port: int, backlog: int = LISTEN_BACKLOG) -> Optional[socket.socket]:
    """The abstract UNIX socket beside a TCP listener on ``port``, or None if it cannot be.

    Abstract names live in the network namespace, as loopback addresses do: exactly the
    processes that reach the server through 127.0.0.1 / ::1 can reach this socket, and it
    disappears with the last process that holds it (no file to clean up). A server creates
    it only when it listens on the wildcard address or on loopback, so no other server can
    own loopback:``port`` at the same time.

    Abstract names have no permissions: any local user can take one first. So a failure to
    bind it is a warning (clients then use TCP), and both ends check each other's user
    (``same_user``): a client never talks to a socket another user holds.
    """
    if not hasattr(socket, "AF_UNIX") or not sys.platform.startswith("linux"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(unix_socket_name(port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        reason = ("another process holds the name (another user's, or a stale server's)"
                  if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc))
        log.warning("cannot listen on the same-host socket @%s: %s; same-host clients use TCP",
                    unix_socket_name(port)[1:].decode(), reason)
        return None
    sock.setblocking(False)
    return sock


def unix_peer(sock: socket.socket) -> str:
    """A same-host client, for logs: loopback (the address it asked for stands for that),
    the transport, and its pid (SO_PEERCRED) when the kernel tells."""
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return f"127.0.0.1:unix (pid {pid})"
    except (OSError, AttributeError, struct.error):
        return "127.0.0.1:unix"


def same_user(sock: socket.socket) -> Optional[str]:
    """None when the process at the other end of a UNIX socket runs as this process's user
    (the kernel's SO_PEERCRED); otherwise which process and user it is."""
    try:
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (OSError, AttributeError, struct.error) as exc:
        return f"a process whose user cannot be checked ({exc})"
    mine = os.geteuid()
    if uid != mine:
        return f"process {pid} of uid {uid}, not of this process's uid {mine}"
    return None


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft
