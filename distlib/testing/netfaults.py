"""Network faults as commands run in a host's network namespace, the same in every substrate.

A partition and packet loss are iptables rules (DROP: silence, as a real cut gives, not an
error) in two chains of the host's own namespace, jumped to from INPUT and OUTPUT: the job's
processes need no capability, and undoing a fault is flushing its chain. Delay is tc netem,
which only kernels built with sch_netem offer (``netem_missing`` says so in one line).

``NetExec`` runs a command in a host's network namespace: ``ip netns exec`` for the process
substrate, ``nsenter`` into a container's namespace for the container substrate.
"""

from __future__ import annotations

import functools
import uuid
from typing import Iterable, List, Optional, Protocol, Tuple

from . import privilege

PARTITION_CHAIN = "DLT-PART"
LOSS_CHAIN = "DLT-LOSS"


class NetExec(Protocol):
    def __call__(self, argv: List[str], input_text: Optional[str] = None) -> Tuple[int, str]: ...


class HostLink:
    """The fault rules of one host's network namespace."""

    def __init__(self, name: str, run: NetExec, interface: str = "eth0"):
        self.name = name
        self.run = run
        self.interface = interface
        self._chains_ready = False
        self._netem = False

    def _restore(self, chain: str, rules: Iterable[str]) -> None:
        lines = ["*filter", f":{chain} - [0:0]"]
        if not self._chains_ready:
            lines += [f":{PARTITION_CHAIN} - [0:0]", f":{LOSS_CHAIN} - [0:0]"] if chain == PARTITION_CHAIN else \
                [f":{LOSS_CHAIN} - [0:0]", f":{PARTITION_CHAIN} - [0:0]"]
            lines += [f"-I INPUT 1 -j {PARTITION_CHAIN}", f"-I OUTPUT 1 -j {PARTITION_CHAIN}",
                      f"-I INPUT 2 -i {self.interface} -j {LOSS_CHAIN}",
                      f"-I OUTPUT 2 -o {self.interface} -j {LOSS_CHAIN}"]
        lines += [f"-A {chain} {rule}" for rule in rules] + ["COMMIT", ""]
        code, out = self.run(["iptables-restore", "--noflush"], input_text="\n".join(lines))
        if code != 0:
            raise RuntimeError(f"{self.name}: iptables-restore failed (exit {code}): {out.strip()[-400:]}")
        self._chains_ready = True

    def block(self, addresses: Iterable[str]) -> None:
        """Drop every packet to or from ``addresses`` (replacing the previous partition)."""
        rules = []
        for address in sorted(set(addresses)):
            rules += [f"-s {address} -j DROP", f"-d {address} -j DROP"]
        self._restore(PARTITION_CHAIN, rules)

    def unblock(self) -> None:
        if self._chains_ready:
            self._restore(PARTITION_CHAIN, [])

    def degrade(self, delay_ms: float, loss_percent: float) -> None:
        rules = [f"-m statistic --mode random --probability {loss_percent / 100:.4f} -j DROP"] if loss_percent else []
        self._restore(LOSS_CHAIN, rules)
        if delay_ms:
            code, out = self.run(["tc", "qdisc", "replace", "dev", self.interface, "root", "netem", "delay",
                                  f"{delay_ms:g}ms"])
            if code != 0:
                raise RuntimeError(f"{self.name}: tc netem failed (exit {code}): {out.strip()[-300:]}")
            self._netem = True

    def restore(self) -> None:
        if self._chains_ready:
            self._restore(LOSS_CHAIN, [])
        if self._netem:
            self.run(["tc", "qdisc", "del", "dev", self.interface, "root"])
            self._netem = False


@functools.lru_cache(maxsize=None)
def netem_missing() -> Optional[str]:
    """None when this kernel offers tc netem, else the one line that says it does not (tried in a
    throwaway network namespace)."""
    if privilege.prefix() is None:
        return f"tc netem: not tried ({privilege.why_not()})"
    netns = f"dlt-probe-{uuid.uuid4().hex[:8]}"
    try:
        privilege.run(["ip", "netns", "add", netns])
        code, out = privilege.run(["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", "lo", "root",
                                   "netem", "delay", "1ms"], check=False)
    except RuntimeError as exc:
        return f"tc netem: cannot be tried here: {exc}"
    finally:
        privilege.run(["ip", "netns", "delete", netns], check=False)
    if code == 0:
        return None
    return (f"tc netem: this kernel has no sch_netem ({out.strip().splitlines()[0] if out.strip() else code}): "
            f"delay faults cannot run (packet loss can: iptables)")
