"""Faults: what a schedule does to the cluster when a cue fires.

Each fault names its target by host (``"node2"``, ``"master"``, or a node's index) or by rank,
and acts through the ``FaultTarget`` the cluster gives it; docs/testing.md says what each does
at the OS level in each substrate. ``needs`` names the substrate's abilities it relies on, so
that a schedule the substrate cannot carry out is refused before the job starts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Dict, FrozenSet, List, Protocol, Sequence, Tuple, Type, Union

Host = Union[int, str]


def host_name(host: Host) -> str:
    """``2`` -> ``"node2"``; names pass through."""
    if isinstance(host, bool):
        raise TypeError(f"a host is a node index or a name, not {host!r}")
    return f"node{host}" if isinstance(host, int) else str(host)


class FaultTarget(Protocol):
    """What a fault may do to the running cluster (cluster.py implements it)."""

    def kill_rank(self, rank: int) -> str: ...
    def kill_node(self, node: str) -> str: ...
    def start_node(self, node: str) -> str: ...
    def pause_node(self, node: str) -> str: ...
    def resume_node(self, node: str) -> str: ...
    def partition(self, groups: List[List[str]]) -> str: ...
    def heal(self) -> str: ...
    def degrade_link(self, node: str, delay_ms: float, loss_percent: float) -> str: ...
    def restore_link(self, node: str) -> str: ...
    def set_resolvable(self, node: str, resolvable: bool) -> str: ...
    def disk(self, state: str) -> str: ...
    def kill_master(self) -> str: ...
    def start_master(self) -> str: ...


class Fault:
    """One action on the cluster; ``apply`` returns a line saying what was done."""

    name: ClassVar[str] = ""
    needs: ClassVar[FrozenSet[str]] = frozenset()

    def apply(self, target: FaultTarget) -> str:
        raise NotImplementedError

    def requirements(self) -> FrozenSet[str]:
        return self.needs

    def to_json(self) -> Dict[str, Any]:
        return {"fault": self.name, **asdict(self)}  # type: ignore[call-overload]


@dataclass(frozen=True)
class Kill(Fault):
    """SIGKILL the process of rank ``rank`` (a worker under a launcher, or the node's process)."""

    rank: int
    name: ClassVar[str] = "kill"
    needs: ClassVar[FrozenSet[str]] = frozenset({"signals"})

    def apply(self, target: FaultTarget) -> str:
        return target.kill_rank(self.rank)

    def __str__(self) -> str:
        return f"kill rank {self.rank}"


@dataclass(frozen=True)
class KillNode(Fault):
    """SIGKILL every process of a host (a container: ``docker kill``), as a power cut would."""

    node: Host
    name: ClassVar[str] = "kill_node"
    needs: ClassVar[FrozenSet[str]] = frozenset({"signals"})

    def apply(self, target: FaultTarget) -> str:
        return target.kill_node(host_name(self.node))

    def __str__(self) -> str:
        return f"kill {host_name(self.node)}"


@dataclass(frozen=True)
class StartNode(Fault):
    """Start a host's command again after a kill (the machine back from a power cut), or for
    the first time when the run was told to hold it back (``Cluster.run(..., held=[...])``: a
    node that joins late)."""

    node: Host
    name: ClassVar[str] = "start_node"
    needs: ClassVar[FrozenSet[str]] = frozenset({"signals"})

    def apply(self, target: FaultTarget) -> str:
        return target.start_node(host_name(self.node))

    def __str__(self) -> str:
        return f"start {host_name(self.node)}"


@dataclass(frozen=True)
class Pause(Fault):
    """Stop every process of a host (SIGSTOP; a container: the cgroup freezer) until ``Resume``."""

    node: Host
    name: ClassVar[str] = "pause"
    needs: ClassVar[FrozenSet[str]] = frozenset({"signals"})

    def apply(self, target: FaultTarget) -> str:
        return target.pause_node(host_name(self.node))

    def __str__(self) -> str:
        return f"pause {host_name(self.node)}"


@dataclass(frozen=True)
class Resume(Fault):
    node: Host
    name: ClassVar[str] = "resume"
    needs: ClassVar[FrozenSet[str]] = frozenset({"signals"})

    def apply(self, target: FaultTarget) -> str:
        return target.resume_node(host_name(self.node))

    def __str__(self) -> str:
        return f"resume {host_name(self.node)}"


@dataclass(frozen=True, init=False)
class Partition(Fault):
    """Split the hosts into groups that cannot reach each other (packets dropped silently, both
    ways); hosts in no group keep reaching everyone. ``Heal`` ends it."""

    groups: Tuple[Tuple[str, ...], ...]
    name: ClassVar[str] = "partition"
    needs: ClassVar[FrozenSet[str]] = frozenset({"network"})

    def __init__(self, *groups: Sequence[Host]):
        if len(groups) == 1 and groups and isinstance(groups[0], (list, tuple)) and groups[0] \
                and isinstance(groups[0][0], (list, tuple)):
            groups = tuple(groups[0])  # Partition([[0, 1], [2]]) as well as Partition([0, 1], [2])
        named = tuple(tuple(host_name(h) for h in g) for g in groups)
        if len(named) < 2 or any(not g for g in named):
            raise ValueError(f"a partition needs at least two non-empty groups of hosts, not {groups!r}")
        seen = [h for g in named for h in g]
        if len(seen) != len(set(seen)):
            raise ValueError(f"a host is in two groups of the partition {groups!r}")
        object.__setattr__(self, "groups", named)

    def apply(self, target: FaultTarget) -> str:
        return target.partition([list(g) for g in self.groups])

    def to_json(self) -> Dict[str, Any]:
        return {"fault": self.name, "groups": [list(g) for g in self.groups]}

    def __str__(self) -> str:
        return "partition " + " | ".join(",".join(g) for g in self.groups)


@dataclass(frozen=True)
class Heal(Fault):
    """End every partition."""

    name: ClassVar[str] = "heal"
    needs: ClassVar[FrozenSet[str]] = frozenset({"network"})

    def apply(self, target: FaultTarget) -> str:
        return target.heal()

    def __str__(self) -> str:
        return "heal the partition"


@dataclass(frozen=True)
class DegradeLink(Fault):
    """Delay (``delay_ms``, tc netem: only where the kernel has sch_netem) and/or drop
    (``loss_percent``, at random, both directions) the packets of a host's link."""

    node: Host
    delay_ms: float = 0.0
    loss_percent: float = 0.0
    name: ClassVar[str] = "degrade_link"

    def requirements(self) -> FrozenSet[str]:
        return frozenset({"network"} | ({"netem"} if self.delay_ms else set()))

    def apply(self, target: FaultTarget) -> str:
        return target.degrade_link(host_name(self.node), self.delay_ms, self.loss_percent)

    def __str__(self) -> str:
        parts = ([f"{self.delay_ms:g} ms delay"] if self.delay_ms else []) + \
                ([f"{self.loss_percent:g}% loss"] if self.loss_percent else [])
        return f"{' and '.join(parts) or 'nothing'} on {host_name(self.node)}'s link"


@dataclass(frozen=True)
class RestoreLink(Fault):
    node: Host
    name: ClassVar[str] = "restore_link"
    needs: ClassVar[FrozenSet[str]] = frozenset({"network"})

    def apply(self, target: FaultTarget) -> str:
        return target.restore_link(host_name(self.node))

    def __str__(self) -> str:
        return f"restore {host_name(self.node)}'s link"


@dataclass(frozen=True)
class Unresolvable(Fault):
    """The host's name stops resolving on every host (its line leaves the hosts file they all
    read) until ``Resolvable``; its address still answers."""

    node: Host
    name: ClassVar[str] = "unresolvable"
    needs: ClassVar[FrozenSet[str]] = frozenset({"names"})

    def apply(self, target: FaultTarget) -> str:
        return target.set_resolvable(host_name(self.node), False)

    def __str__(self) -> str:
        return f"make {host_name(self.node)} unresolvable"


@dataclass(frozen=True)
class Resolvable(Fault):
    node: Host
    name: ClassVar[str] = "resolvable"
    needs: ClassVar[FrozenSet[str]] = frozenset({"names"})

    def apply(self, target: FaultTarget) -> str:
        return target.set_resolvable(host_name(self.node), True)

    def __str__(self) -> str:
        return f"make {host_name(self.node)} resolvable again"


@dataclass(frozen=True)
class Disk(Fault):
    """The shared directory (``/shared`` on every host: where a FileStore lives): ``"full"``
    (writes fail with ENOSPC), ``"readonly"`` (EROFS) or ``"ok"`` (both undone)."""

    state: str
    name: ClassVar[str] = "disk"
    needs: ClassVar[FrozenSet[str]] = frozenset({"disk"})

    def requirements(self) -> FrozenSet[str]:
        return self.needs | ({"readonly"} if self.state == "readonly" else set())

    def __post_init__(self) -> None:
        if self.state not in ("full", "readonly", "ok"):
            raise ValueError(f"Disk state must be 'full', 'readonly' or 'ok', not {self.state!r}")

    def apply(self, target: FaultTarget) -> str:
        return target.disk(self.state)

    def __str__(self) -> str:
        return {"full": "fill the shared directory", "readonly": "make the shared directory read-only",
                "ok": "restore the shared directory"}[self.state]


@dataclass(frozen=True)
class KillMaster(Fault):
    """SIGKILL the master service (the store every rank rendezvouses through)."""

    name: ClassVar[str] = "kill_master"
    needs: ClassVar[FrozenSet[str]] = frozenset({"master"})

    def apply(self, target: FaultTarget) -> str:
        return target.kill_master()

    def __str__(self) -> str:
        return "kill the master service"


@dataclass(frozen=True)
class StartMaster(Fault):
    """Start the master service again on the same host and port: empty (its keys are gone), or
    with its keys replayed from its journal when the run keeps them (``keep_master_state``)."""

    name: ClassVar[str] = "start_master"
    needs: ClassVar[FrozenSet[str]] = frozenset({"master"})

    def apply(self, target: FaultTarget) -> str:
        return target.start_master()

    def __str__(self) -> str:
        return "start the master service again"


@dataclass(frozen=True)
class RestartMaster(Fault):
    """Kill the master service and start it again at once on the same address (with its keys
    under ``keep_master_state``, as StartMaster)."""

    name: ClassVar[str] = "restart_master"
    needs: ClassVar[FrozenSet[str]] = frozenset({"master"})

    def apply(self, target: FaultTarget) -> str:
        return target.kill_master() + "; " + target.start_master()

    def __str__(self) -> str:
        return "restart the master service"


FAULTS: Dict[str, Type[Fault]] = {f.name: f for f in (
    Kill, KillNode, StartNode, Pause, Resume, Partition, Heal, DegradeLink, RestoreLink, Unresolvable, Resolvable, Disk,
    KillMaster, StartMaster, RestartMaster)}


def from_json(data: Dict[str, Any]) -> Fault:
    fields = dict(data)
    kind = fields.pop("fault", None)
    if kind not in FAULTS:
        raise ValueError(f"unknown fault {kind!r} in {data} (known: {', '.join(sorted(FAULTS))})")
    if kind == "partition":
        return Partition(*fields.get("groups", ()))
    return FAULTS[kind](**fields)


