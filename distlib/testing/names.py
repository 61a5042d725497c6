"""The cluster's host names: one hosts file that every host reads as /etc/hosts.

"This host's name does not resolve" is a line taken out of that file, in place (the hosts
bind-mount the file, so it must stay the same file); glibc reads /etc/hosts at every lookup,
so the change is seen at once everywhere, and undone the same way.
"""

from __future__ import annotations

import os
import threading
from typing import Dict, Set


#: every host's /etc/resolv.conf: no DNS server (nothing listens on the host's own loopback), so
#: a name resolves from the hosts file or not at all, at once; the engine's DNS (a container
#: network's resolves container names) and the machine's resolver stay out of it
RESOLV_CONF = "# distlib.testing: host names come from /etc/hosts only\nnameserver 127.0.0.1\noptions attempts:1 timeout:1\n"


class HostsFile:
    def __init__(self, path: str):
        self.path = path
        self.resolv_conf = os.path.join(os.path.dirname(path), "resolv.conf")
        with open(self.resolv_conf, "w") as fh:
            fh.write(RESOLV_CONF)
        self.addresses: Dict[str, str] = {}
        self.hidden: Set[str] = set()
        self._lock = threading.Lock()

    def set(self, addresses: Dict[str, str]) -> None:
        with self._lock:
            self.addresses = dict(addresses)
            self._write()

    def resolvable(self, name: str, yes: bool) -> None:
        if name not in self.addresses:
            raise ValueError(f"no host {name!r} (hosts: {', '.join(self.addresses)})")
        with self._lock:
            (self.hidden.discard if yes else self.hidden.add)(name)
            self._write()

    def text(self) -> str:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{address}\t{name}" for name, address in self.addresses.items() if name not in self.hidden]
        return "\n".join(lines) + "\n"

    def _write(self) -> None:
        data = self.text().encode()
        # In place: truncating and writing keeps the inode every host has bind-mounted.
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
