"""Hosts as Linux namespaces on this machine: a network namespace per host, joined by a bridge
in a namespace of its own (the switch), a UTS namespace for its host name and a mount
namespace in which the cluster's hosts file is /etc/hosts.

Nothing is added to the machine's own network: the switch and the hosts live in namespaces
named ``dlt-<harness pid>-<cluster>-<host>``, removed when the cluster closes, and swept when
a crashed harness (its pid gone) left them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
import re
import signal
from dataclasses import dataclass
from typing import Dict, List, Optional

from . import privilege

SUBNET = "10.99.0"          # private to the switch: nothing outside the namespaces sees it
FIRST_HOST = 10
NAME = re.compile(r"^dlt-(\d+)-")


@dataclass
class NamespaceHost:
    name: str
    netns: str
    address: str


class Fabric:
    """The switch and the hosts' network namespaces of one cluster."""

    def __init__(self, tag: str):
        self.prefix = f"dlt-{os.getpid()}-{tag}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: Dict[str, NamespaceHost] = {}
        sweep()
        self._ip("netns", "add", self.switch)
        self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.switch, "link", "set", "br0", "up")

    @staticmethod
    def _ip(*args: str) -> str:
        return privilege.run(["ip", *args])[1]

    def add(self, name: str, address_index: int) -> NamespaceHost:
        """The host ``name`` (made on first use; later runs of the cluster reuse it)."""
        if name in self.hosts:
            return self.hosts[name]
        netns = f"{self.prefix}-{len(self.hosts)}"
        port = f"p{len(self.hosts)}"
        address = f"{SUBNET}.{address_index}"
        self._ip("netns", "add", netns)
        # One `ip -batch` per namespace instead of a process per step: starting 8 hosts stays quick.
        privilege.run(["ip", "-n", self.switch, "-batch", "-"], input_text=(
            f"link add {port} type veth peer name eth0 netns {netns}\n"
            f"link set {port} master br0 up\n"))
        privilege.run(["ip", "-n", netns, "-batch", "-"], input_text=(
            f"link set lo up\naddr add {address}/24 dev eth0\nlink set eth0 up\n"))
        host = NamespaceHost(name, netns, address)
        self.hosts[name] = host
        return host

    def close(self) -> None:
        for host in self.hosts.values():
            remove_netns(host.netns)
        remove_netns(self.switch)
        self.hosts.clear()


@functools.lru_cache(maxsize=None)
def unavailable() -> Optional[str]:
    """None when this runner can make network namespaces, else the one line saying why not
    (tried: being root is not enough in a container without CAP_SYS_ADMIN, e.g. GitLab's
    Docker executor unless privileged)."""
    why = privilege.why_not()
    if why:
        return why
    probe = f"dlt-probe-{uuid.uuid4().hex[:8]}"
    code, out = privilege.run(["ip", "netns", "add", probe], check=False)
    privilege.run(["ip", "netns", "delete", probe], check=False)
    if code != 0:
        return f"`ip netns add` fails here: {out.strip().splitlines()[-1] if out.strip() else code}"
    return None


def netns_pids(netns: str) -> List[int]:
    code, out = privilege.run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in out.split()] if code == 0 else []


def remove_netns(netns: str) -> None:
    """Kill whatever still runs in ``netns``, then delete it."""
    for _ in range(3):
        pids = netns_pids(netns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            if privilege.prefix():  # not root: processes may be root's
                privilege.run(["kill", "-9", str(pid)], check=False)
    privilege.run(["ip", "netns", "delete", netns], check=False)


def sweep() -> List[str]:
    """Remove the namespaces of harnesses that are gone (a crash, a kill -9 of pytest)."""
    code, out = privilege.run(["ip", "netns", "list"], check=False)
    removed = []
    for line in out.splitlines() if code == 0 else []:
        name = line.split()[0] if line.split() else ""
        m = NAME.match(name)
        if m and not privilege.pid_alive(int(m.group(1))):
            remove_netns(name)
            removed.append(name)
    return removed
