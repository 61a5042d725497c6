"""Fault schedules: steps of (cue, fault), in order; random ones from a seed; saved, replayed
and shrunk.

Steps are armed one at a time: step i+1's cue counts only once step i has fired, so "partition,
then heal 5 s later" and "kill the master at the first store wait, start it at the next" say
what they mean. A schedule is plain JSON (``save``/``load``), the artefact a failing CI run
keeps; ``shrink`` removes steps while the failure persists, down to a schedule from which no
single step can go.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import cues as cue_types
from . import faults as fault_types
from .cues import Cue
from .faults import Fault

StepLike = Union["Step", Tuple[Cue, Fault]]


@dataclass(frozen=True)
class Step:
    cue: Cue
    fault: Fault

    def to_json(self) -> Dict[str, Any]:
        return {"cue": self.cue.to_json(), "fault": self.fault.to_json()}

    def __str__(self) -> str:
        return f"at {self.cue}: {self.fault}"


@dataclass
class Schedule:
    """An ordered list of steps; ``seed`` is kept when it was drawn by ``random``."""

    steps: List[Step] = field(default_factory=list)
    seed: Optional[int] = None

    @classmethod
    def of(cls, steps: Union["Schedule", Iterable[StepLike], None]) -> "Schedule":
        if steps is None:
            return cls()
        if isinstance(steps, Schedule):
            return steps
        out = []
        for step in steps:
            if isinstance(step, Step):
                out.append(step)
            else:
                cue, fault = step
                if not isinstance(cue, Cue) or not isinstance(fault, Fault):
                    raise TypeError(f"a step is (cue, fault), e.g. (cues.Collective(0, 5), faults.KillNode(2)); "
                                    f"got {step!r}")
                out.append(Step(cue, fault))
        return cls(out)

    def requirements(self) -> set:
        return {need for step in self.steps for need in step.fault.requirements()}

    def to_json(self) -> Dict[str, Any]:
        return {"seed": self.seed, "steps": [s.to_json() for s in self.steps]}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Schedule":
        return cls([Step(cue_types.from_json(s["cue"]), fault_types.from_json(s["fault"])) for s in data["steps"]],
                   data.get("seed"))

    def save(self, path: Union[str, Path], **context: Any) -> Path:
        """Write the schedule (and ``context``, e.g. the test's id) as JSON."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**context, **self.to_json()}, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Schedule":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a fault schedule ({exc})") from exc

    def without(self, index: int) -> "Schedule":
        return Schedule(self.steps[:index] + self.steps[index + 1:], self.seed)

    def __len__(self) -> int:
        return len(self.steps)

    def __str__(self) -> str:
        head = f"schedule (seed {self.seed})" if self.seed is not None else "schedule"
        return head + ":" + "".join(f"\n  {i + 1}. {s}" for i, s in enumerate(self.steps)) if self.steps else \
            head + ": no faults"

    @classmethod
    def random(cls, seed: int, ranks: int, collectives: int, steps: int = 2,
               faults: Sequence[str] = ("kill", "pause", "partition", "restart_master")) -> "Schedule":
        """``steps`` faults drawn from ``faults`` at collectives drawn from 1..``collectives`` of
        ranks drawn from 0..``ranks``-1 (node i runs rank i). A pause is followed by its resume
        and a partition by its heal, 1-3 collectives later on the same rank, so that what is
        drawn is a hiccup the job may survive, not a hang; the same seed gives the same
        schedule."""
        rng = random.Random(seed)
        out: List[Step] = []
        for _ in range(steps):
            kind = rng.choice(list(faults))
            rank = rng.randrange(ranks)
            n = rng.randint(1, max(1, collectives))
            cue = cue_types.Collective(rank, n)
            victim = rng.randrange(ranks)
            if kind == "kill":
                out.append(Step(cue, fault_types.KillNode(victim)))
            elif kind == "pause":
                out.append(Step(cue, fault_types.Pause(victim)))
                out.append(Step(cue_types.After(round(rng.uniform(0.2, 1.5), 1)), fault_types.Resume(victim)))
            elif kind == "partition":
                others = [h for h in range(ranks) if h != victim]
                out.append(Step(cue, fault_types.Partition([victim], others)))
                out.append(Step(cue_types.After(round(rng.uniform(0.2, 1.5), 1)), fault_types.Heal()))
            elif kind == "restart_master":
                out.append(Step(cue, fault_types.RestartMaster()))
            else:
                raise ValueError(f"Schedule.random: unknown fault kind {kind!r} (kill, pause, partition, "
                                 f"restart_master)")
        return cls(out, seed)


def shrink(schedule: Schedule, fails: Callable[[Schedule], bool], log: Optional[Callable[[str], None]] = None
           ) -> Schedule:
    """The smallest schedule found, by removing steps, for which ``fails`` still holds: no single
    step of the result can be removed without the failure going away (1-minimal). ``fails`` runs
    the job (it is called at most len(schedule)**2 / 2 times)."""
    current = schedule
    changed = True
    while changed and len(current) > 0:
        changed = False
        for i in range(len(current)):
            candidate = current.without(i)
            if log:
                log(f"shrink: trying without step {i + 1} ({current.steps[i]})")
            if fails(candidate):
                current, changed = candidate, True
                break
    return current
