"""The ``--dry-run`` text: every resolved value, where it came from, and each worker's variables.

Plain text meant for people (and simple enough to grep): a table of ``setting  value  source``,
the notes and warnings of the resolver, the command, and one block of ``NAME=value`` lines per
local worker. Nothing is started or contacted; with ``--node-rank auto`` the node rank (and so
RANK and GROUP_RANK) is shown as ``auto``.
"""

from __future__ import annotations

from typing import List, Optional

from ..keyspace import KeySpace
from .elastic_config import ElasticPlan
from .resolve import Resolved
from .workerenv import Placement, Program, torchrun_env, worker_env


def _elastic_rows(plan: ElasticPlan) -> List[tuple]:
    conf = plan.conf
    return [
        ("elastic nodes", plan.range_text, "--nnodes (elastic: rounds on the rendezvous store)"),
        ("max-restarts", plan.max_restarts, "--max-restarts (for the whole job, not per node)"),
        ("monitor-interval", f"{plan.monitor_interval:g} s", "--monitor-interval"),
        ("heartbeat bound", f"{conf.heartbeat_bound:g} s",
         f"--rdzv-conf keep_alive_interval {conf.keep_alive_interval:g} s x keep_alive_max_attempt "
         f"{conf.keep_alive_max_attempt}"),
        ("join_timeout", f"{conf.join_timeout:g} s", "--rdzv-conf"),
        ("last_call_timeout", f"{conf.last_call_timeout:g} s", "--rdzv-conf"),
        ("store outage bound", f"{plan.outage_bound:g} s",
         "--store-outage-timeout or DISTLIB_STORE_OUTAGE_TIMEOUT (the job rides out a store away this long)"),
    ]


def _rows(resolved: Resolved) -> List[tuple]:
    node_rank = "auto" if resolved.node_rank_auto else resolved.node_rank.value
    store = "master service (c10d endpoint)" if resolved.c10d else "master (global rank 0 hosts the store)"
    master = [] if resolved.rdzv_file is not None else [
        ("master-addr", resolved.master_addr.value, f"{resolved.master_addr.source}; {store}"),
        ("master-port", resolved.master_port.value, resolved.master_port.source),
    ]
    rows = [
        ("nnodes", resolved.nnodes.value, resolved.nnodes.source),
        ("nproc-per-node", resolved.nproc_per_node.value, resolved.nproc_per_node.source),
        ("node-rank", node_rank, resolved.node_rank.source),
        ("world size", resolved.world_size, "nnodes x nproc-per-node"),
        ("rdzv-backend", resolved.rdzv_backend.value, resolved.rdzv_backend.source),
        *master,
        ("run-id", resolved.run_id.value, resolved.run_id.source),
    ]
    if resolved.rdzv_file is not None:
        rows.append(("rdzv file", resolved.rdzv_file.value,
                     f"{resolved.rdzv_file.source}; round N's workers get DISTLIB_INIT_METHOD=file://<it>.<run id>."
                     "attempt_N"))
    if resolved.init_method is not None:
        rows.append(("init method", resolved.init_method.value,
                     f"{resolved.init_method.source}; passed to the workers, no TCP store started or contacted"))
    for name, value in resolved.extra_env.items():
        rows.append((name, value.value, value.source))
    return rows


def dry_run_text(resolved: Resolved, program: Program, plan: Optional[ElasticPlan] = None) -> str:
    lines = ["distlib-run --dry-run: resolved settings (nothing started, nothing contacted)", ""]
    rows = _rows(resolved) + (_elastic_rows(plan) if plan else [])
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(str(r[1])) for r in rows)
    for name, value, source in rows:
        lines.append(f"  {name:<{width}}  {str(value):<{vwidth}}  from {source}")
    if resolved.notes:
        lines += ["", "notes:"] + [f"  - {n}" for n in resolved.notes]
    if resolved.warnings:
        lines += ["", "warnings:"] + [f"  - {w}" for w in resolved.warnings]
    if plan is not None:
        lines += ["", "elastic: node ranks, RANK, WORLD_SIZE and TORCHELASTIC_RESTART_COUNT come from each round; "
                      "shown below as in round 0 with this node as node rank " + str(resolved.node_rank.value)]
    lines += ["", f"command (each worker): {program.describe()}"]
    for local_rank in range(resolved.nproc_per_node.value):
        if resolved.node_rank_auto:
            env = worker_env(resolved, local_rank, 0)
            for name in ("RANK", "GROUP_RANK", "NODE_RANK", "ROLE_RANK"):
                env[name] = "auto"
        elif plan is not None:
            node, nproc = resolved.node_rank.value, resolved.nproc_per_node.value
            init = ("file://" + KeySpace(str(resolved.run_id.value), 0).file_store(str(resolved.rdzv_file.value))
                    if resolved.rdzv_file is not None else None)
            env = torchrun_env(resolved, Placement(node * nproc + local_rank, local_rank, resolved.world_size, node,
                                                   resolved.nnodes.value, nproc, 0, plan.max_restarts), init,
                               agent_store=init is None)
        else:
            env = worker_env(resolved, local_rank)
        lines += ["", f"worker local rank {local_rank}:"] + [f"  {k}={v}" for k, v in env.items()]
    return "\n".join(lines) + "\n"
