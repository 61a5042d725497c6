"""What runs in the ranks of ``distlib bench collectives`` (bench/collectives.py describes the
measurement): a rank of a measuring group (init once, then serve ("measure", ...) messages),
a rank of an init measurement, and ``RankGroup``, the parent's handle on N rank children of
one implementation. collectives_cuda.py starts GPU ranks through the same ``serve`` and
``RankGroup``.
"""

from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from distlib.store_service import free_port
from .cases import Case, measure
from .children import BenchError, Child
from .collectives_ops import DISTLIB_GLOO
from .results import DISTLIB, TORCH
from .timing import sleep_until


def child_env(env: Dict[str, str], rank: int, world: int, port: int) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def _dist(impl: str):
    """(the torch.distributed-like module, how to wrap a numpy array for it)."""
    if impl == TORCH:
        import torch
        import torch.distributed as tdist

        # torch 2.13 calls all_gather_into_tensor / reduce_scatter_tensor deprecated (FutureWarning
        # per call); the ops are the ones distlib implements, so measure them quietly.
        warnings.filterwarnings("ignore", category=FutureWarning)
        return tdist, torch.from_numpy
    import distlib

    return distlib, (lambda a: a)


def _shm_state(impl: str) -> Optional[str]:
    """Whether distlib's gloo backend took the shared-memory path ("on", "off", "unset")."""
    if impl not in (DISTLIB, DISTLIB_GLOO):  # (the forked groups run gloo: DISTLIB only with --backend gloo)
        return None
    try:
        from distlib.group import world

        group = world.default_pg
        if group is None:  # no group (yet): nothing to say
            return None
        return getattr(group.backend_for("cpu"), "shm_state", None)
    except Exception:  # noqa: BLE001 - informative only
        return None


def rank_child(conn, impl: str, rank: int, world: int, port: int, env: Dict[str, str],
                timeout_s: float) -> Dict[str, Any]:
    """One rank of a measuring group: init, then serve ("measure", ...) until "stop"."""
    child_env(env, rank, world, port)
    dist, wrap = _dist(impl)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    conn.send(("ready", rank))

    def prepare(op: str, count: int, dtype: str):
        case = Case(op, count, dtype, rank, world)
        return case, case.bind(dist, wrap)

    return serve(conn, rank, dist, prepare, extra=lambda: {"shm": _shm_state(impl)})


def serve(conn, rank: int, dist, prepare: Callable[[str, int, str], Tuple[Any, Callable[[], Any]]],
          sync: Callable[[], None] = lambda: None, extra: Callable[[], Dict[str, Any]] = dict) -> Dict[str, Any]:
    """A rank's loop: answer ("measure", op, count, dtype, iters, warmup, validate) until "stop",
    then destroy the group. ``prepare`` gives (the case: fill, check, zero; the call to time);
    ``sync`` makes the host wait for the arrays' work (a GPU's), around the timed region."""
    measured = 0
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent is gone
            break
        if msg[0] == "stop":
            break
        _, op, count, dtype, iters, warmup, validate = msg
        reply: Dict[str, Any] = {"rank": rank}
        try:
            case, call = prepare(op, count, dtype)
            reply.update(measure(case, call, dist.barrier, iters, warmup, validate, sync=sync))
            del call, case
        except Exception as exc:  # noqa: BLE001 - e.g. an op this torch's gloo lacks: reported per row
            reply["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        reply.update(extra())
        measured += 1
        conn.send(("result", reply))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a failed group; the process exits anyway
        pass
    return {"measured": measured}


def init_child(conn, impl: str, rank: int, world: int, port: int, env: Dict[str, str], go, start_at,
                timeout_s: float) -> Dict[str, Any]:
    """One rank of an init measurement: wait for the common start instant, init, check the
    group with one all_reduce (untimed), destroy."""
    child_env(env, rank, world, port)
    dist, wrap = _dist(impl)
    import numpy as np

    conn.send(("ready", rank))
    if not go.wait(timeout_s):
        raise BenchError(f"no start signal within {timeout_s:.0f} s")
    sleep_until(start_at.value)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    t1 = time.perf_counter()
    one = np.ones(1, np.float32)
    dist.all_reduce(wrap(one))
    if one[0] != world:
        raise BenchError(f"rank {rank}: all_reduce after init gave {one[0]}, expected {world}")
    dist.destroy_process_group()
    return {"t0": t0, "t1": t1}


# -- parent side -------------------------------------------------------------------------------


class RankGroup:
    """N rank children of one implementation, kept for the whole sweep. ``start_rank(rank,
    port)`` starts one rank's child (a CPU rank here, a GPU rank in collectives_cuda); the
    ranks rendezvous on ``port`` and answer once they have joined."""

    def __init__(self, impl: str, nranks: int, timeout_s: float, start_rank: Callable[[int, int], Child]):
        self.impl, self.n, self.timeout_s = impl, nranks, timeout_s
        port = free_port()
        self.ranks: List[Child] = []
        try:
            for r in range(nranks):
                self.ranks.append(start_rank(r, port))
            for child in self.ranks:
                child.recv(timeout_s)
        except BaseException:
            self.stop()
            raise

    def measure(self, impl: str, op: str, count: int, dtype: str, iters: int, warmup: int,
                validate: bool) -> List[Dict]:
        del impl  # one group, one implementation
        for child in self.ranks:
            child.send(("measure", op, count, dtype, iters, warmup, validate))
        return [child.recv(self.timeout_s) for child in self.ranks]

    def stop(self) -> None:
        for child in self.ranks:
            child.stop()
