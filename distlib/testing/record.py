"""What a run leaves: a record per host and per rank, and the assertions users make on them.

A rank's record is assembled from the events (events.py): its process(es) by RANK, the
collectives it entered, the exception that ended it, the store operations the master service
saw from its host, its host's output. Assertion failures say which rank was wrong and show what
it said, so a CI log is enough to understand a failure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Pattern, Tuple, Type, Union

from .events import Event

ExceptionSpec = Union[str, Type[BaseException], Tuple[Union[str, Type[BaseException]], ...]]


@dataclass
class HostRecord:
    """One host: its address, its main process's end, its output."""

    name: str
    address: str
    exit_code: Optional[int] = None  # None: still running when the run ended (then killed)
    signal: Optional[int] = None     # the signal that ended it, if one did
    output: List[str] = field(default_factory=list)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output[-lines:])


@dataclass
class RankRecord:
    """One rank (RANK=r) over the whole run; an elastic job's restarts are in ``incarnations``."""

    rank: int
    host: str
    pids: List[int] = field(default_factory=list)
    restarts: List[int] = field(default_factory=list)
    world_sizes: List[int] = field(default_factory=list)
    exception_type: Optional[str] = None
    #: the names of the classes ``exception_type`` derives from (e.g. DistStoreError, DistError)
    exception_bases: List[str] = field(default_factory=list)
    exception_text: Optional[str] = None
    exception_time: Optional[float] = None
    collectives: int = 0
    last_collective: Optional[Tuple[int, str]] = None
    exited_cleanly: bool = False    # its interpreter shut down normally (no uncaught exception)
    exit_code: Optional[int] = None  # known when the rank is its host's main process
    signal: Optional[int] = None
    store_ops: List[Tuple[float, str, Tuple[str, ...]]] = field(default_factory=list)
    started: Optional[float] = None
    output: List[str] = field(default_factory=list)
    value: Any = None                # a function job's return value

    @property
    def ended(self) -> str:
        if self.signal is not None:
            return f"killed by signal {self.signal}"
        if self.exception_type:
            return f"raised {self.exception_type}: {self.exception_text}"
        if self.exit_code is not None:
            return f"exited with status {self.exit_code}"
        return "exited" if self.exited_cleanly else "vanished (no exit report: killed, or still running)"

    def summary(self) -> str:
        last = f"collective #{self.last_collective[0]} ({self.last_collective[1]})" if self.last_collective else \
            "no collective"
        return f"rank {self.rank} on {self.host}: {self.ended}; last {last}"


def _matches(rec: "RankRecord", spec: ExceptionSpec) -> bool:
    """Whether the rank's exception is one of ``spec`` or derives from one, as ``except`` reads it."""
    specs = spec if isinstance(spec, tuple) else (spec,)
    names = [s if isinstance(s, str) else s.__name__ for s in specs]
    return rec.exception_type is not None and any(n in names for n in [rec.exception_type] + rec.exception_bases)


def naming_pattern(naming: Union[None, int, str, Pattern[str]]) -> Optional[Pattern[str]]:
    """An int r means "names rank r" (``rank r`` as a word); a string is a literal, a pattern a regex."""
    if naming is None:
        return None
    if isinstance(naming, int):
        return re.compile(rf"\brank {naming}\b")
    if isinstance(naming, str):
        return re.compile(re.escape(naming))
    return naming


@dataclass
class Result:
    """Everything one run left. ``hang`` is the deadline report when the run ran out of time."""

    hosts: Dict[str, HostRecord]
    ranks: Dict[int, RankRecord]
    events: List[Event]
    faults: List[Dict[str, Any]]
    started: float
    ended: float
    hang: Optional[str] = None
    run_dir: str = ""

    # --- what users ask ---------------------------------------------------------------------

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    def fault_time(self, index: int = -1) -> float:
        if not self.faults:
            raise AssertionError("no fault fired in this run:\n" + self.report())
        return self.faults[index]["t"]

    def survivors(self, victims: Iterable[int] = ()) -> List[RankRecord]:
        lost = set(victims)
        return [r for k, r in sorted(self.ranks.items()) if k not in lost]

    def report(self, tail: int = 15) -> str:
        """Each rank's end and last collective, the faults fired, and each host's last lines."""
        lines = [f"run of {self.seconds:.1f} s in {self.run_dir}"]
        lines += [f"  fault at +{f['t'] - self.started:.2f} s ({f['cue']}): {f['did']}" for f in self.faults]
        lines += ["  " + r.summary() for _, r in sorted(self.ranks.items())]
        for host in self.hosts.values():
            end = ("still running" if host.exit_code is None else
                   f"signal {host.signal}" if host.signal is not None else f"exit {host.exit_code}")
            lines.append(f"--- {host.name} ({host.address}, {end}), last lines:")
            lines += ["  " + line for line in host.output[-tail:]]
        if self.hang:
            lines.append(self.hang)
        return "\n".join(lines)

    def _fail(self, what: str) -> None:
        raise AssertionError(f"{what}\n{self.report()}")

    def assert_no_hang(self) -> "Result":
        if self.hang:
            self._fail("the run hit its deadline (a hang)")
        return self

    def assert_ok(self, world_size: Optional[int] = None) -> "Result":
        """Every host's main process exited 0, no rank raised, and (if given) ``world_size`` ranks ran."""
        self.assert_no_hang()
        bad = [f"{h.name} exited with {h.exit_code}" + (f" (signal {h.signal})" if h.signal else "")
               for h in self.hosts.values() if h.name != "master" and h.exit_code != 0]
        bad += [r.summary() for r in self.ranks.values() if r.exception_type]
        if world_size is not None and sorted(self.ranks) != list(range(world_size)):
            bad.append(f"ranks {sorted(self.ranks)} ran, expected 0..{world_size - 1}")
        if bad:
            self._fail("the job did not succeed: " + "; ".join(bad))
        return self

    def assert_survivors_raised(self, exception: ExceptionSpec, naming: Union[None, int, str, Pattern[str]] = None,
                                within: Optional[float] = None, victims: Iterable[int] = ()) -> "Result":
        """Every rank but ``victims`` raised ``exception`` (a class or its name, or a tuple of
        them; a subclass counts, as ``except`` reads it) whose text matches ``naming`` (an int r:
        "rank r"), within ``within`` seconds of the last fault."""
        self.assert_no_hang()
        pattern = naming_pattern(naming)
        t0 = self.fault_time() if within is not None else 0.0
        wrong = []
        for rec in self.survivors(victims):
            if not _matches(rec, exception):
                wrong.append(f"rank {rec.rank} {rec.ended}")
            elif pattern is not None and not pattern.search(rec.exception_text or ""):
                wrong.append(f"rank {rec.rank}'s {rec.exception_type} does not name {pattern.pattern!r}: "
                             f"{rec.exception_text}")
            elif within is not None and rec.exception_time is not None and rec.exception_time - t0 > within:
                wrong.append(f"rank {rec.rank} raised {rec.exception_time - t0:.1f} s after the fault "
                             f"(more than {within:g} s)")
        if not self.survivors(victims):
            wrong.append("no surviving rank to check")
        if wrong:
            self._fail(f"expected every survivor to raise {exception!r}: " + "; ".join(wrong))
        return self

    def assert_finished(self, world_size: int, restarts: int = 0) -> "Result":
        """An elastic job finished (every host exited 0) with ``world_size`` ranks after
        ``restarts`` restarts: its last round's ranks are 0..world_size-1, all of restart
        ``restarts``."""
        self.assert_no_hang()
        last = [e for e in self.events if e.kind == "hello" and e.rank >= 0]
        final = max((e.data.get("restart", 0) for e in last), default=None)
        in_final = sorted({e.rank for e in last if e.data.get("restart", 0) == final})
        bad = [f"{h.name} exited with {h.exit_code}" for h in self.hosts.values()
               if h.name != "master" and h.name in self._live() and h.exit_code != 0]
        if final != restarts:
            bad.append(f"the last round was restart {final}, expected {restarts}")
        if in_final != list(range(world_size)):
            bad.append(f"the last round ran ranks {in_final}, expected 0..{world_size - 1}")
        if bad:
            self._fail("the elastic job did not finish as expected: " + "; ".join(bad))
        return self

    def _live(self) -> List[str]:
        """Hosts no fault killed."""
        killed = {f.get("host") for f in self.faults if f.get("kind") == "kill_node"}
        return [h for h in self.hosts if h not in killed]
