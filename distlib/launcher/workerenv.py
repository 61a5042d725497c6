"""The environment each worker gets, and the command it runs.

torchrun's variables: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME``,
``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_USE_AGENT_STORE``, and
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` unless the launcher's environment sets it. For a fixed-size job the restart count and
the maximum are 0; for an elastic one (``round_env``) they are the job's: the round's number,
the same on every node. distlib adds
``NODE_RANK`` (= GROUP_RANK; Lightning and many scripts read it), ``DISTLIB_RUN_ID`` and
``DISTLIB_EXTERNAL_STORE``.

``TORCHELASTIC_USE_AGENT_STORE`` and ``DISTLIB_EXTERNAL_STORE`` are always set, to ``True``/``1``
(c10d: every rank is a client of the master service) or ``False``/``0`` (static: global rank 0
hosts the store). Set explicitly either way, because a value inherited from the launcher's
own environment would otherwise reach the workers and turn rank 0 into a client of a server
nobody runs (or the reverse). Everything else is inherited from the launcher's environment;
the pod-level ``RANK``/``WORLD_SIZE`` a cluster manager may have put there (conventions.py)
are replaced, which is the point.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from ..identity import Identity
from .resolve import Resolved


@dataclass(frozen=True)
class Program:
    """What every worker runs: ``python -u -m module args`` or ``python -u script args``."""

    target: str
    args: Sequence[str] = ()
    module: bool = False
    python: Optional[str] = None

    def argv(self) -> List[str]:
        python = self.python or os.environ.get("PYTHON_EXEC") or sys.executable
        return [python, "-u", *(["-m"] if self.module else []), self.target, *self.args]

    def describe(self) -> str:
        return " ".join(self.argv())


def worker_env(resolved: Resolved, local_rank: int, node_rank: Optional[int] = None,
               role: str = "default") -> Dict[str, str]:
    """The variables the launcher sets for one worker of a fixed-size job (not the inherited ones)."""
    node = resolved.node_rank.value if node_rank is None else node_rank
    if node is None:
        raise ValueError("the node rank is not known yet (--node-rank auto): assign it first")
    nproc = resolved.nproc_per_node.value
    return torchrun_env(resolved, Placement(node * nproc + local_rank, local_rank, resolved.world_size, node,
                                            resolved.nnodes.value, nproc, role=role))


@dataclass(frozen=True)
class Placement:
    """Where one worker sits in its round: ranks and sizes, and the job's restart count."""

    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    nnodes: int
    nproc: int
    restart_count: int = 0
    max_restarts: int = 0
    role: str = "default"


def torchrun_env(resolved: Resolved, where: Placement, init_method: Optional[str] = None,
                 agent_store: Optional[bool] = None) -> Dict[str, str]:
    """torchrun's variables for one worker at ``where`` (module docstring): the worker's
    ``Identity`` (distlib/identity.py, which names every variable once) as the environment.
    ``init_method`` replaces MASTER_ADDR/MASTER_PORT (an elastic job's file store of the round).
    ``agent_store``: whether the store already runs (default: with c10d); an elastic job's always does."""
    external = resolved.c10d if agent_store is None else agent_store
    own_file = init_method is not None
    identity = Identity(
        rank=where.rank, world_size=where.world_size, local_rank=where.local_rank, local_world_size=where.nproc,
        node_rank=where.node_rank, nnodes=where.nnodes,
        master_addr=None if own_file else str(resolved.master_addr.value),
        master_port=None if own_file else int(resolved.master_port.value),
        run_id=str(resolved.run_id.value), restart_count=where.restart_count, max_restarts=where.max_restarts,
        role=where.role, external_store=external and not own_file,
        init_method=init_method or (str(resolved.init_method.value) if resolved.init_method else ""))
    env = identity.environ()
    for name, value in resolved.extra_env.items():
        env[name] = str(value.value)
    return env


def full_env(base: Mapping[str, str], resolved: Resolved, local_rank: int,
             node_rank: Optional[int] = None, role: str = "default") -> Dict[str, str]:
    """The launcher's environment with one worker's variables on top."""
    env = dict(base)
    env.update(worker_env(resolved, local_rank, node_rank, role))
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env


def round_env(base: Mapping[str, str], resolved: Resolved, where: Placement,
              init_method: Optional[str] = None) -> Dict[str, str]:
    """The launcher's environment with one elastic worker's variables on top. With a file store
    (``init_method``), MASTER_ADDR/MASTER_PORT inherited from a cluster are removed: they would
    name a store this job does not use."""
    env = dict(base)
    if init_method is not None:
        env.pop("MASTER_ADDR", None)
        env.pop("MASTER_PORT", None)
    env.update(torchrun_env(resolved, where, init_method, agent_store=init_method is None))
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env
