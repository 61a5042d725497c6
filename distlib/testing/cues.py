"""Cues: the events at which a schedule's faults fire.

A cue is a predicate over the run's events (events.py), never a clock reading, so that the same
schedule puts its fault at the same point of the job in every run. ``After`` is the one
exception, for faults that are about time itself (a master down for 5 s), and it counts from the
previous step, not from the start of the process.

A ``Collective`` cue is exact: the rank is held at that collective until the fault is in place.
The others fire when the harness hears of the event (store operations from the master service's
observer, output lines through the substrate's pipe): docs/testing.md has the measured lag.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Dict, Optional, Type

from .events import Event


class Cue:
    """A predicate over events (``matches``), or a delay (``After``)."""

    name: ClassVar[str] = ""
    #: seconds after the previous step (only After has one)
    delay: Optional[float] = None

    def matches(self, event: Event) -> bool:
        return False

    def gate(self, hello: Event) -> Optional[int]:
        """The collective number at which the process that said ``hello`` must be held, if any."""
        return None

    def armed(self) -> "Cue":
        """The cue as the schedule arms it (a fresh copy for cues with a state, like AllOf)."""
        return self

    def to_json(self) -> Dict[str, Any]:
        return {"cue": self.name, **{k: v for k, v in asdict(self).items() if v is not None}}  # type: ignore[call-overload]


@dataclass(frozen=True)
class Collective(Cue):
    """Rank ``rank`` enters its collective number ``n`` (1 = the first, counted per process over
    every group; receives are not counted), of kind ``op`` if given, in restart ``restart`` of an
    elastic job if given."""

    rank: int
    n: int
    op: Optional[str] = None
    restart: Optional[int] = None
    name: ClassVar[str] = "collective"

    def matches(self, event: Event) -> bool:
        return (event.kind == "collective" and event.rank == self.rank and event.data.get("n") == self.n
                and (self.op is None or event.data.get("op") == self.op)
                and (self.restart is None or event.data.get("restart") == self.restart))

    def gate(self, hello: Event) -> Optional[int]:
        if hello.rank != self.rank or (self.restart is not None and hello.data.get("restart") != self.restart):
            return None
        return self.n

    def __str__(self) -> str:
        return f"rank {self.rank} enters collective #{self.n}" + (f" ({self.op})" if self.op else "")


@dataclass(frozen=True)
class StoreOp(Cue):
    """The master service receives ``op`` (set, get, add, wait, compare_set, check, ...; None:
    any) on a key matching the glob ``key``, from host ``node`` if given."""

    key: str = "*"
    op: Optional[str] = None
    node: Optional[str] = None
    name: ClassVar[str] = "store"

    def matches(self, event: Event) -> bool:
        return (event.kind == "store" and (self.op is None or event.data.get("op") == self.op)
                and (self.node is None or event.node == self.node)
                and any(fnmatch.fnmatchcase(k, self.key) for k in event.data.get("keys", ())))

    def __str__(self) -> str:
        return f"store {self.op or 'operation'} on {self.key!r}" + (f" from {self.node}" if self.node else "")


@dataclass(frozen=True)
class Output(Cue):
    """A line of output (stdout or stderr) of host ``node`` (any if None) matches the regular
    expression ``pattern`` (``re.search``)."""

    pattern: str
    node: Optional[str] = None
    name: ClassVar[str] = "output"

    def matches(self, event: Event) -> bool:
        return (event.kind == "output" and (self.node is None or event.node == self.node)
                and re.search(self.pattern, event.data.get("line", "")) is not None)

    def __str__(self) -> str:
        return f"output matching {self.pattern!r}" + (f" on {self.node}" if self.node else "")


def Round(n: int, node: Optional[str] = None) -> Output:  # noqa: N802 - reads as a cue class
    """Round ``n`` (>= 1) of an elastic ``distlib-run`` job opens: its agents print
    ``distlib-run: round N (restart N of at most M): ...``."""
    return Output(rf"^distlib-run: round {int(n)} \(", node)


@dataclass(frozen=True)
class Started(Cue):
    """A process with RANK ``rank`` (or any Python process of host ``node``) has started."""

    rank: Optional[int] = None
    node: Optional[str] = None
    name: ClassVar[str] = "started"

    def matches(self, event: Event) -> bool:
        return (event.kind == "hello" and (self.rank is None or event.rank == self.rank)
                and (self.node is None or event.node == self.node))

    def __str__(self) -> str:
        return "start of " + (f"rank {self.rank}" if self.rank is not None else f"a process on {self.node or 'any host'}")


@dataclass(frozen=True)
class After(Cue):
    """``seconds`` after the previous step fired (after the start of the run for the first)."""

    seconds: float
    name: ClassVar[str] = "after"

    @property
    def delay(self) -> float:  # type: ignore[override]  # a Cue's delay field, computed here
        return self.seconds

    def __str__(self) -> str:
        return f"{self.seconds:g} s later"


class AllOf(Cue):
    """Every one of ``cues`` has happened (in any order) since the step was armed: "each of the
    three nodes printed 'waiting'". Delays (After) cannot be part of it."""

    name: ClassVar[str] = "all"

    def __init__(self, *cues: Cue):
        if not cues or any(c.delay is not None for c in cues):
            raise ValueError("AllOf needs one or more event cues (no After)")
        self.cues = tuple(cues)
        self._left = list(cues)

    def armed(self) -> "AllOf":
        return AllOf(*self.cues)

    def matches(self, event: Event) -> bool:
        self._left = [c for c in self._left if not c.matches(event)]
        return not self._left

    def gate(self, hello: Event) -> Optional[int]:
        return None  # a collective inside AllOf is not held: which one completes it is not known ahead

    def to_json(self) -> Dict[str, Any]:
        return {"cue": self.name, "of": [c.to_json() for c in self.cues]}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AllOf) and other.cues == self.cues

    def __hash__(self) -> int:
        return hash(self.cues)

    def __str__(self) -> str:
        return "all of: " + "; ".join(str(c) for c in self.cues)


CUES: Dict[str, Type[Cue]] = {c.name: c for c in (Collective, StoreOp, Output, Started, After)}


def from_json(data: Dict[str, Any]) -> Cue:
    fields = dict(data)
    kind = fields.pop("cue", None)
    if kind == AllOf.name:
        return AllOf(*[from_json(c) for c in fields.get("of", ())])
    if kind not in CUES:
        raise ValueError(f"unknown cue {kind!r} in {data} (known: {', '.join(sorted(CUES))})")
    return CUES[kind](**fields)
