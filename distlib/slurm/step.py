"""Who this process is in a Slurm job step, read from the variables ``srun`` gives each task.

``srun`` starts every task of a step with ``SLURM_PROCID`` (the task's rank), ``SLURM_NTASKS``
(the step's tasks), ``SLURM_LOCALID`` (the task's index on its node), ``SLURM_NODEID`` (the
node's index in the step), ``SLURM_NNODES``, ``SLURM_STEP_TASKS_PER_NODE`` (compressed:
``2(x3),1``), ``SLURM_STEP_NODELIST`` (compressed: ``node[1-4]``), ``SLURM_JOB_ID`` and
``SLURM_STEP_ID``, and no MASTER_ADDR or MASTER_PORT. This module maps them onto torch's
names, each value with the variable(s) it came from; both the env:// init method
(distlib/rendezvous.py) and ``distlib-run`` (distlib/launcher/conventions.py) read it, which
is why it sits at the bottom layer.

* only inside a step: ``SLURM_STEP_ID`` and ``SLURM_PROCID`` set. A batch script or an
  ``salloc`` shell has ``SLURM_JOB_ID`` but is no step: its one process is not rank 0 of
  ``SLURM_NTASKS`` (``outside_step_hint`` says so);
* ``MASTER_ADDR``: the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``,
  ``SLURM_NODELIST``), where the task of rank 0 runs with Slurm's default block distribution;
* ``MASTER_PORT``: ``port_for(job, step)`` = 20000 + 10 x (``SLURM_JOB_ID`` mod 1000) +
  (``SLURM_STEP_ID`` mod 10): the same in every task of a step, different for the steps of a
  job and for 1000 consecutive jobs, and below Linux's ephemeral ports (32768 and up);
* the run id: ``slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>``.

Variables that contradict each other (``SLURM_PROCID`` not below ``SLURM_NTASKS``, a node
list shorter than ``SLURM_NNODES``, tasks per node that do not add up) give a ``Reading``
whose ``error`` names them; the caller raises it when it uses that value, before it waits
on anyone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generic, Iterable, List, Mapping, Optional, Tuple, TypeVar

from .hostlist import HostlistError, expand

PORT_BASE = 20000
PORT_RULE = "20000 + 10 x (SLURM_JOB_ID mod 1000) + (SLURM_STEP_ID mod 10)"
NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_REPEAT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


T = TypeVar("T")


class SlurmError(ValueError):
    """Slurm's variables cannot describe this task (the message names them)."""


@dataclass(frozen=True)
class Reading(Generic[T]):
    """One value Slurm's variables give: ``value`` (None when they give none) and ``source``
    (the variables, as ``NAME=value``); ``error`` instead of a value when they contradict."""

    value: Optional[T]
    source: str
    error: Optional[str] = None

    def get(self) -> Optional[T]:
        """The value; SlurmError when the variables contradict each other."""
        if self.error:
            raise SlurmError(self.error)
        return self.value


def _get(env: Mapping[str, str], name: str) -> Optional[str]:
    value = env.get(name)
    value = value.strip() if value is not None else None
    return value or None


def in_step(env: Mapping[str, str]) -> bool:
    """Whether ``env`` is a task of an ``srun`` step (SLURM_STEP_ID and SLURM_PROCID set)."""
    return _get(env, "SLURM_STEP_ID") is not None and _get(env, "SLURM_PROCID") is not None


def outside_step_hint(env: Mapping[str, str]) -> str:
    """A sentence for a missing RANK when Slurm allocated this process but did not start it as
    a step's task (a batch script, an salloc shell); "" otherwise."""
    job = _get(env, "SLURM_JOB_ID")
    if job is None or in_step(env):
        return ""
    return (f" (SLURM_JOB_ID={job} is set but this is no srun step: no SLURM_STEP_ID/SLURM_PROCID. Start one "
            "process per rank with `srun python ...`, or one distlib-run per node with `srun --ntasks-per-node=1 "
            "distlib-run --nproc-per-node N ...`)")


def parse_tasks_per_node(text: str, source: str) -> List[int]:
    """Slurm's compressed counts per node: ``2(x3),1`` → ``[2, 2, 2, 1]``.

    Raises:
        SlurmError: ``text`` is not in that form (``source`` names the variable).
    """
    counts: List[int] = []
    for part in text.split(","):
        match = _REPEAT.fullmatch(part.strip())
        if match is None:
            raise SlurmError(f"{source}={text!r}: {part.strip()!r} is not N or N(xM) (e.g. 2(x3),1)")
        tasks, times = int(match.group(1)), int(match.group(2) or 1)
        if times < 1:
            raise SlurmError(f"{source}={text!r}: {part.strip()!r} repeats a count {times} times")
        counts.extend([tasks] * times)
    return counts


def port_for(job_id: int, step_id: int) -> int:
    """MASTER_PORT for step ``step_id`` of job ``job_id`` (the rule in the module docstring)."""
    return PORT_BASE + 10 * (job_id % 1000) + step_id % 10


class Step:
    """Slurm's variables of one task, read lazily into ``Reading``s (one property each)."""

    def __init__(self, env: Mapping[str, str]):
        self.env = env
        self._cache: Dict[str, Reading[Any]] = {}

    def _once(self, name: str, make: Callable[[], Reading[T]]) -> Reading[T]:
        if name not in self._cache:
            try:
                self._cache[name] = make()
            except SlurmError as exc:
                self._cache[name] = Reading(None, "", str(exc))
        return self._cache[name]

    def _int(self, name: str, minimum: int) -> Tuple[Optional[int], str]:
        text = _get(self.env, name)
        if text is None:
            return None, name
        if not text.isdigit() or int(text) < minimum:
            raise SlurmError(f"{name}={text!r} is not an integer of at least {minimum}")
        return int(text), f"{name}={text}"

    # -- counts ----------------------------------------------------------------------------------

    @property
    def world_size(self) -> Reading[int]:
        def make() -> Reading[int]:
            for name in ("SLURM_NTASKS", "SLURM_NPROCS"):
                value, source = self._int(name, 1)
                if value is not None:
                    return Reading(value, source)
            return Reading(None, "SLURM_NTASKS")
        return self._once("world_size", make)

    @property
    def rank(self) -> Reading[int]:
        def make() -> Reading[int]:
            value, source = self._int("SLURM_PROCID", 0)
            world = self.world_size.get()
            if value is not None and world is not None and value >= world:
                raise SlurmError(f"{source} is not below {self.world_size.source}: task ranks go from 0 to "
                                 f"{world - 1}")
            return Reading(value, source)
        return self._once("rank", make)

    @property
    def nnodes(self) -> Reading[int]:
        def make() -> Reading[int]:
            value, source = self._int("SLURM_NNODES", 1)
            if value is None:
                value, source = self._int("SLURM_STEP_NUM_NODES", 1)
            return Reading(value, source)
        return self._once("nnodes", make)

    @property
    def node_rank(self) -> Reading[int]:
        def make() -> Reading[int]:
            value, source = self._int("SLURM_NODEID", 0)
            nodes = self.nnodes.get()
            if value is not None and nodes is not None and value >= nodes:
                raise SlurmError(f"{source} is not below {self.nnodes.source}: node indices go from 0 to "
                                 f"{nodes - 1}")
            return Reading(value, source)
        return self._once("node_rank", make)

    @property
    def tasks_per_node(self) -> Reading[List[int]]:
        """The tasks on each node of the step, as a list (checked against the counts)."""
        def make() -> Reading[List[int]]:
            nodes = self.nnodes.get()
            world = self.world_size.get()
            for name in TASKS_PER_NODE:
                text = _get(self.env, name)
                if text is None:
                    continue
                counts = parse_tasks_per_node(text, name)
                source = f"{name}={text}"
                if nodes is not None and len(counts) != nodes:
                    raise SlurmError(f"{source} gives the tasks of {len(counts)} node(s), but "
                                     f"{self.nnodes.source}")
                if world is not None and sum(counts) != world:
                    raise SlurmError(f"{source} adds up to {sum(counts)} task(s), but {self.world_size.source}")
                return Reading(counts, source)
            value, source = self._int("SLURM_NTASKS_PER_NODE", 1)
            if value is not None and nodes is not None:
                counts = [value] * nodes
                if world is not None and sum(counts) != world:
                    raise SlurmError(f"{source} x {self.nnodes.source} is {sum(counts)} task(s), but "
                                     f"{self.world_size.source}")
                return Reading(counts, f"{source} on each of {self.nnodes.source}")
            return Reading(None, TASKS_PER_NODE[0])
        return self._once("tasks_per_node", make)

    @property
    def local_world_size(self) -> Reading[int]:
        def make() -> Reading[int]:
            counts = self.tasks_per_node.get()
            node = self.node_rank.get()
            if counts is None or node is None:
                return Reading(None, self.tasks_per_node.source)
            return Reading(counts[node], f"{self.tasks_per_node.source} at {self.node_rank.source}")
        return self._once("local_world_size", make)

    @property
    def local_rank(self) -> Reading[int]:
        def make() -> Reading[int]:
            value, source = self._int("SLURM_LOCALID", 0)
            here = self.local_world_size.get()
            if value is not None and here is not None and value >= here:
                raise SlurmError(f"{source} is not below the {here} task(s) of this node "
                                 f"({self.local_world_size.source})")
            return Reading(value, source)
        return self._once("local_rank", make)

    @property
    def one_task_per_node(self) -> Reading[bool]:
        """Whether every node of the step runs one task (the shape for one distlib-run per node)."""
        def make() -> Reading[bool]:
            counts = self.tasks_per_node.get()
            if counts is not None:
                return Reading(all(c == 1 for c in counts), self.tasks_per_node.source)
            nodes, world = self.nnodes.get(), self.world_size.get()
            if nodes is None or world is None:
                return Reading(None, "SLURM_NNODES, SLURM_NTASKS")
            return Reading(nodes == world, f"{self.world_size.source}, {self.nnodes.source}")
        return self._once("one_task_per_node", make)

    # -- where rank 0 is -------------------------------------------------------------------------

    @property
    def nodes(self) -> Reading[List[str]]:
        """The step's host names (the first node list found, expanded)."""
        def make() -> Reading[List[str]]:
            nodes = self.nnodes.get()
            for name in NODELISTS:
                text = _get(self.env, name)
                if text is None:
                    continue
                try:
                    hosts = expand(text)
                except HostlistError as exc:
                    raise SlurmError(f"{name}: {exc}") from None
                source = f"{name}={text}"
                if not hosts:
                    raise SlurmError(f"{source} names no host")
                if nodes is not None and len(hosts) < nodes:
                    raise SlurmError(f"{source} names {len(hosts)} host(s), fewer than {self.nnodes.source}")
                if nodes is not None and name == NODELISTS[0] and len(hosts) != nodes:
                    raise SlurmError(f"{source} names {len(hosts)} hosts, but {self.nnodes.source}")
                return Reading(hosts, source)
            return Reading(None, NODELISTS[0])
        return self._once("nodes", make)

    @property
    def master_addr(self) -> Reading[str]:
        def make() -> Reading[str]:
            hosts = self.nodes.get()
            if hosts is None:
                return Reading(None, self.nodes.source)
            return Reading(hosts[0], f"the first host of {self.nodes.source}")
        return self._once("master_addr", make)

    @property
    def master_port(self) -> Reading[int]:
        def make() -> Reading[int]:
            job, job_source = self._int("SLURM_JOB_ID", 0)
            step, step_source = self._int("SLURM_STEP_ID", 0)
            if job is None or step is None:
                return Reading(None, "SLURM_JOB_ID, SLURM_STEP_ID")
            return Reading(port_for(job, step), f"{job_source}, {step_source} ({PORT_RULE})")
        return self._once("master_port", make)

    @property
    def run_id(self) -> Reading[str]:
        def make() -> Reading[str]:
            job, step = _get(self.env, "SLURM_JOB_ID"), _get(self.env, "SLURM_STEP_ID")
            if job is None or step is None:
                return Reading(None, "SLURM_JOB_ID, SLURM_STEP_ID")
            return Reading(f"slurm-{job}.{step}", f"SLURM_JOB_ID={job}, SLURM_STEP_ID={step}")
        return self._once("run_id", make)


#: torch's variables a task of ``srun python ...`` gets from ``torch_environment``, and the
#: Step property each comes from. The first four are what env:// reads.
TORCH_VARIABLES = (("RANK", "rank"), ("WORLD_SIZE", "world_size"), ("MASTER_ADDR", "master_addr"),
                   ("MASTER_PORT", "master_port"), ("LOCAL_RANK", "local_rank"),
                   ("LOCAL_WORLD_SIZE", "local_world_size"), ("GROUP_RANK", "node_rank"),
                   ("GROUP_WORLD_SIZE", "nnodes"), ("TORCHELASTIC_RUN_ID", "run_id"))
#: Those a task gets only when its RANK came from Slurm too: they describe the same task.
_WITH_RANK = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def torch_environment(env: Mapping[str, str], given: Iterable[str] = ()) -> Dict[str, Tuple[str, str]]:
    """What an ``srun`` task lacks of torch's variables, from Slurm's: ``{name: (value, source)}``.

    Each of RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT that ``env`` lacks (unset or empty)
    and ``given`` does not name (e.g. a rank passed as an argument) comes from Slurm; when RANK
    does, so do the missing LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE and (no
    DISTLIB_RUN_ID being set) TORCHELASTIC_RUN_ID, what torchrun would have set. Outside a
    step: ``{}``.

    Raises:
        SlurmError: a needed value's variables contradict each other (the message names them),
            or a variable env:// needs cannot be had from them.
    """
    if not in_step(env):
        return {}
    step = Step(env)
    given = set(given)
    out: Dict[str, Tuple[str, str]] = {}
    rank_from_slurm = _get(env, "RANK") is None and "RANK" not in given
    for name, attribute in TORCH_VARIABLES:
        if _get(env, name) is not None or name in given or (name in _WITH_RANK and not rank_from_slurm):
            continue
        if name == "TORCHELASTIC_RUN_ID" and _get(env, "DISTLIB_RUN_ID") is not None:
            continue  # the job's own run id (settings.run_id reads TORCHELASTIC_RUN_ID first)
        reading: Reading = getattr(step, attribute)
        value = reading.get()
        if value is None:
            if name in _WITH_RANK:
                continue
            raise SlurmError(f"inside Slurm step {_get(env, 'SLURM_JOB_ID')}.{_get(env, 'SLURM_STEP_ID')}, "
                             f"{name} is not set and {reading.source} is not set either")
        out[name] = (str(value), reading.source)
    return out
