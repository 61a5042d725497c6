"""Which address a rank advertises to its peers, which port it listens on, which host it is on.

The address must be one the peers can reach. By default it is the local address of this
rank's connection to the master store: that route demonstrably works, whereas resolving the
host name often gives 127.0.1.1 (Debian's /etc/hosts) or a container-internal name.
``GLOO_SOCKET_IFNAME=eth0[,eth1...]`` names interfaces instead, as torch's gloo reads it
(several → one connection per interface, operations round-robin). With a FileStore there is
no store connection: the address of the interface that holds the default route is used.

``DISTLIB_PORT_RANGE=30000-30100`` confines data ports to a range, so firewalls and
container port maps need only that range; a busy range is an error that names it.

The host identity decides which peers can share memory: the kernel's boot id, the network
namespace and the /dev/shm filesystem must all match (separate containers on one machine
differ in the last two and talk over TCP).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from typing import List, Optional, Tuple

from ....errors import DistNetworkError

log = logging.getLogger("distlib.transport.address")

_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (ioctl SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            names = ", ".join(n for _, n in socket.if_nameindex())
            raise DistNetworkError(
                f"GLOO_SOCKET_IFNAME names interface {name!r}, which has no IPv4 address here "
                f"({exc.strerror}); interfaces on this host: {names}") from None
    return socket.inet_ntoa(packed[20:24])


def interfaces_from_env() -> List[str]:
    value = os.environ.get("GLOO_SOCKET_IFNAME", "").strip()
    return [part.strip() for part in value.split(",") if part.strip()]


def default_route_address() -> str:
    """The local address the kernel would use to reach the outside (no packet is sent)."""
    for target in ("10.255.255.255", "192.0.2.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((target, 9))
                address = sock.getsockname()[0]
                if address and address != "0.0.0.0":
                    return address
        except OSError:
            continue
    return "127.0.0.1"


def store_connection_address(store) -> Optional[str]:
    """The local address of the store client's connection, if ``store`` (the end of the group's
    store chain: the caller unwraps it, store.chain.innermost) is a TCPStore."""
    local = getattr(store, "local_address", None)
    return local() if callable(local) else None


def advertised_addresses(store) -> List[Tuple[str, str]]:
    """[(address, why)]: one per GLOO_SOCKET_IFNAME interface, else one default (``store``: the
    end of the group's store chain)."""
    names = interfaces_from_env()
    if names:
        return [(interface_address(n), f"GLOO_SOCKET_IFNAME={n}") for n in names]
    address = store_connection_address(store)
    if address:
        if address.startswith("::ffff:"):
            address = address[7:]
        return [(address, "the local end of this rank's connection to the store")]
    return [(default_route_address(), "the interface of the default route")]


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def listen(bind_address: str, port_range: Optional[Tuple[int, int]], backlog: int) -> socket.socket:
    """A listening socket on ``bind_address``, on a port from ``port_range`` if given."""
    family = socket.AF_INET6 if ":" in bind_address else socket.AF_INET
    ports = range(port_range[0], port_range[1] + 1) if port_range else [0]
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((bind_address, port))
        except OSError as exc:
            sock.close()
            if port_range is None:  # any port: the address itself is the problem
                raise DistNetworkError(f"cannot listen on {bind_address} (errno {exc.errno}: {exc.strerror}): "
                                       "is it an address of this host?") from exc
            continue
        sock.listen(backlog)
        return sock
    assert port_range is not None, "with any port, the loop returns or raises"
    raise DistNetworkError(
        f"no free port in DISTLIB_PORT_RANGE={port_range[0]}-{port_range[1]} on {bind_address}: "
        f"all {len(ports)} ports are in use; widen the range or stop what holds them")


def host_identity() -> str:
    """Equal for processes that can share memory: same kernel, network namespace and /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    try:
        shm = os.stat("/dev/shm")
        shm_id = f"{shm.st_dev}:{shm.st_ino}"
    except OSError:
        shm_id = "none"
    return f"{boot}/{netns}/{shm_id}"
