"""Who this process is in its job, read once, as a value: rank, world size, local rank, node,
the master's address, the run id and the restart count.

A launcher (torchrun, ``distlib-run``) tells each worker through torch's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ...); inside an ``srun`` step Slurm's variables stand in for
those the environment lacks (distlib/slurm/step.py has the mapping and docs/launcher.md the
table). ``Identity.read(environ, rank, world_size)`` gathers them, with the caller's arguments
first, each with the words for where it came from, and changes nothing: it writes no
``os.environ``. Code that needs a value later asks for it (``distlib.get_node_local_rank()``,
``get_rank()``) or keeps the ``Identity``; nothing depends on a side effect of init.

``Identity.environ()`` is the reverse, what a launcher sets for a worker
(distlib/launcher/workerenv.py), so that every variable's name and meaning is written once.

A value that is present but unusable (``RANK=x``, Slurm's variables contradicting each other) is
kept as a problem and raised only by ``need`` (an ``IdentityError``, a ValueError naming the
variables), so a process that never uses it is not stopped by it — as env:// raises for a
missing ``RANK`` only when it reads ``RANK``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Dict, Mapping, Optional, Tuple, Union

from . import settings
from .keyspace import KeySpace
from .slurm import step as slurm_step

Value = Union[int, str, None]

#: Each field of an Identity read from a variable: (field, torch's variable, the Slurm Step
#: property that stands in for it inside an srun step), env://'s four first.
VARIABLES: Tuple[Tuple[str, str, str], ...] = (
    ("rank", "RANK", "rank"),
    ("world_size", "WORLD_SIZE", "world_size"),
    ("master_addr", "MASTER_ADDR", "master_addr"),
    ("master_port", "MASTER_PORT", "master_port"),
    ("local_rank", "LOCAL_RANK", "local_rank"),
    ("local_world_size", "LOCAL_WORLD_SIZE", "local_world_size"),
    ("node_rank", "GROUP_RANK", "node_rank"),
    ("nnodes", "GROUP_WORLD_SIZE", "nnodes"),
)
_TEXT_FIELDS = ("master_addr",)
#: Filled from Slurm only when RANK came from Slurm too: they describe the same task.
_WITH_RANK = ("local_rank", "local_world_size", "node_rank", "nnodes")
_VARIABLE = {name: variable for name, variable, _ in VARIABLES}


class IdentityError(ValueError):
    """A value this process needs is missing or unusable (the message names the variables)."""


@dataclass(frozen=True)
class Identity:
    """This process's place in its job (module docstring); None: nobody said."""

    rank: Optional[int] = None
    world_size: Optional[int] = None
    local_rank: Optional[int] = None
    local_world_size: Optional[int] = None
    #: GROUP_RANK (distlib-run also sets NODE_RANK): the node's index in the job.
    node_rank: Optional[int] = None
    #: GROUP_WORLD_SIZE: the job's nodes.
    nnodes: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    #: TORCHELASTIC_RUN_ID, else DISTLIB_RUN_ID (settings.run_id), else Slurm's job and step.
    run_id: str = ""
    #: TORCHELASTIC_RESTART_COUNT: the elastic round, the same for every rank.
    restart_count: int = 0
    #: TORCHELASTIC_MAX_RESTARTS.
    max_restarts: int = 0
    #: ROLE_NAME.
    role: str = "default"
    #: whether every rank is a client of a store already running (settings.external_store).
    external_store: bool = False
    #: DISTLIB_INIT_METHOD: the init method a launcher chose (a file mode), or "".
    init_method: str = ""
    #: field -> where its value came from, in words ("RANK=3, from the environment").
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    #: field -> why the value there cannot be used (raised by ``need``).
    problems: Mapping[str, str] = field(default_factory=dict, compare=False)
    #: field -> why it is missing, when "not set" alone would mislead (a batch script: no step).
    hints: Mapping[str, str] = field(default_factory=dict, compare=False)
    #: field -> Slurm's variables its value came from (an srun task's values; for the log).
    from_slurm: Mapping[str, str] = field(default_factory=dict, compare=False)

    # -- reading ---------------------------------------------------------------------------------

    @classmethod
    def read(cls, environ: Optional[Mapping[str, str]] = None, rank: int = -1, world_size: int = -1) -> "Identity":
        """This process's identity from ``environ`` (default ``os.environ``, which is not
        changed) and the caller's ``rank``/``world_size`` (-1: not given), which come first."""
        env = os.environ if environ is None else environ
        values: Dict[str, Value] = {}
        sources: Dict[str, str] = {}
        problems: Dict[str, str] = {}
        for name, given in (("rank", rank), ("world_size", world_size)):
            if given != -1:
                values[name] = given
                sources[name] = f"{name}={given}, from the {name}= argument"
        for name, variable, _ in VARIABLES:
            text = _get(env, variable)
            if name in values or text is None:
                continue
            if name in _TEXT_FIELDS:
                values[name] = text
            else:
                try:
                    values[name] = int(text)
                except ValueError:
                    problems[name] = f"{variable}={text!r} is not an integer"
                    continue
            sources[name] = f"{variable}={text}, from the environment"
        run_id = settings.run_id(env)
        if run_id:
            sources["run_id"] = "TORCHELASTIC_RUN_ID" if _get(env, "TORCHELASTIC_RUN_ID") else "DISTLIB_RUN_ID"
        hints: Dict[str, str] = {}
        from_slurm: Dict[str, str] = {}
        if slurm_step.in_step(env):
            run_id = _from_slurm(env, values, sources, problems, from_slurm, run_id)
        else:
            hint = slurm_step.outside_step_hint(env)
            hints = {name: hint for name, _, _ in VARIABLES} if hint else {}
        restart = _count(env, "TORCHELASTIC_RESTART_COUNT", problems, "restart_count")
        max_restarts = _count(env, "TORCHELASTIC_MAX_RESTARTS", problems, "max_restarts")
        return cls(**values, run_id=run_id, restart_count=restart, max_restarts=max_restarts,  # type: ignore[arg-type]
                   role=_get(env, "ROLE_NAME") or "default", external_store=settings.external_store(env),
                   init_method=settings.init_method(env), sources=sources, problems=problems, hints=hints,
                   from_slurm=from_slurm)

    def need(self, name: str) -> Value:
        """The value of field ``name``; IdentityError when it is missing or unusable, with
        env://'s words for a missing variable ("environment variable RANK expected, but not set")."""
        if name in self.problems:
            raise IdentityError(self.problems[name])
        value = getattr(self, name)
        if value is None:
            raise IdentityError(f"environment variable {_VARIABLE.get(name, name)} expected, but not set"
                                + self.hints.get(name, ""))
        return value

    def source(self, name: str) -> str:
        """Where field ``name`` came from, in words ("" when nobody set it)."""
        return self.sources.get(name, "")

    def with_values(self, **values: Value) -> "Identity":
        """A copy with ``values`` set by the caller (an init method's URL, an argument)."""
        return replace(self, **values)  # type: ignore[arg-type]

    @property
    def keys(self) -> KeySpace:
        """Where this process's job keeps its keys: (run id, attempt) (keyspace.py)."""
        return KeySpace(self.run_id, self.restart_count)

    # -- writing (a launcher) ----------------------------------------------------------------------

    def environ(self) -> Dict[str, str]:
        """torch's variables for a worker with this identity (what torchrun sets), with distlib's
        NODE_RANK, DISTLIB_RUN_ID, DISTLIB_EXTERNAL_STORE and DISTLIB_INIT_METHOD; a field that
        is None is left out (a file store's job has no MASTER_ADDR)."""
        # in the order --dry-run has always listed them (docs/launcher.md)
        pairs = (("RANK", self.rank), ("LOCAL_RANK", self.local_rank), ("WORLD_SIZE", self.world_size),
                 ("LOCAL_WORLD_SIZE", self.local_world_size), ("GROUP_RANK", self.node_rank),
                 ("NODE_RANK", self.node_rank), ("GROUP_WORLD_SIZE", self.nnodes), ("ROLE_RANK", self.rank),
                 ("ROLE_WORLD_SIZE", self.world_size), ("ROLE_NAME", self.role), ("MASTER_ADDR", self.master_addr),
                 ("MASTER_PORT", self.master_port))
        env = {name: str(value) for name, value in pairs if value is not None}
        env["TORCHELASTIC_RUN_ID"] = env["DISTLIB_RUN_ID"] = self.run_id
        env["TORCHELASTIC_RESTART_COUNT"] = str(self.restart_count)
        env["TORCHELASTIC_MAX_RESTARTS"] = str(self.max_restarts)
        # always set, either way: a value inherited from the launcher's environment would
        # otherwise turn rank 0 into a client of a server nobody runs (or the reverse)
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True" if self.external_store else "False"
        env["DISTLIB_EXTERNAL_STORE"] = "1" if self.external_store else "0"
        if self.init_method:
            env["DISTLIB_INIT_METHOD"] = self.init_method
        return env


def _get(env: Mapping[str, str], name: str) -> Optional[str]:
    """The variable's value, stripped; empty counts as unset (as torch's env:// reads it)."""
    value = env.get(name)
    value = value.strip() if value is not None else None
    return value or None


def _count(env: Mapping[str, str], variable: str, problems: Dict[str, str], name: str) -> int:
    text = _get(env, variable)
    if text is None:
        return 0
    if not text.isdigit():
        problems[name] = f"{variable}={text!r} is not a count (0, 1, 2, ...)"
        return 0
    return int(text)


def _from_slurm(env: Mapping[str, str], values: Dict[str, Value], sources: Dict[str, str],
                problems: Dict[str, str], from_slurm: Dict[str, str], run_id: str) -> str:
    """Inside an srun step: what torch's variables (and the arguments) left unset, from Slurm's
    (slurm/step.py), as torchrun would have set them; returns the run id."""
    step = slurm_step.Step(env)
    rank_from_slurm = "rank" not in values and "rank" not in problems
    where = f"Slurm step {_get(env, 'SLURM_JOB_ID')}.{_get(env, 'SLURM_STEP_ID')}"
    for name, variable, attribute in VARIABLES:
        if name in values or name in problems or (name in _WITH_RANK and not rank_from_slurm):
            continue
        reading: slurm_step.Reading = getattr(step, attribute)
        if reading.error:
            problems[name] = f"{reading.error} (Slurm's variables of this srun task)"
        elif reading.value is not None:
            values[name] = reading.value
            sources[name] = f"{variable}={reading.value}, from {reading.source} (srun)"
            from_slurm[name] = reading.source
        elif name not in _WITH_RANK:
            problems[name] = f"inside {where}, {variable} is not set and {reading.source} is not set either"
    if not run_id and rank_from_slurm and step.run_id.value is not None:
        run_id = str(step.run_id.value)
        sources["run_id"] = f"{step.run_id.source} (srun)"
        from_slurm["run_id"] = step.run_id.source
    return run_id
