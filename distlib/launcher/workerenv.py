"""The environment each worker gets, and the command it runs.

torchrun's variables, with the values torchrun gives them for a fixed-size job without
restarts: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT=0``,
``TORCHELASTIC_MAX_RESTARTS=0``, ``TORCHELASTIC_USE_AGENT_STORE``. distlib adds
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


def worker_env(resolved: Resolved, local_rank: int, node_rank: Optional[int] = None) -> Dict[str, str]:
    """The variables the launcher sets for one worker (not the inherited ones)."""
    node = resolved.node_rank.value if node_rank is None else node_rank
    if node is None:
        raise ValueError("the node rank is not known yet (--node-rank auto): assign it first")
    nproc = resolved.nproc_per_node.value
    rank = node * nproc + local_rank
    world = resolved.world_size
    run_id = str(resolved.run_id.value)
    external = resolved.c10d
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(node),
        "NODE_RANK": str(node),
        "GROUP_WORLD_SIZE": str(resolved.nnodes.value),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "ROLE_NAME": "default",
        "MASTER_ADDR": str(resolved.master_addr.value),
        "MASTER_PORT": str(resolved.master_port.value),
        "TORCHELASTIC_RUN_ID": run_id,
        "DISTLIB_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True" if external else "False",
        "DISTLIB_EXTERNAL_STORE": "1" if external else "0",
    }
    if resolved.init_method is not None:
        env["DISTLIB_INIT_METHOD"] = str(resolved.init_method.value)
    for name, value in resolved.extra_env.items():
        env[name] = str(value.value)
    return env


def full_env(base: Mapping[str, str], resolved: Resolved, local_rank: int,
             node_rank: Optional[int] = None) -> Dict[str, str]:
    """The launcher's environment with one worker's variables on top."""
    env = dict(base)
    env.update(worker_env(resolved, local_rank, node_rank))
    return env
