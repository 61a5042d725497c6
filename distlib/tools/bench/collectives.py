"""``distlib bench collectives``: an nccl-tests-style table of collective bandwidth and latency,
side by side with torch's gloo when torch is importable and raw mpi4py (the floor) when mpi4py
and mpirun are there.

Two backends (``--backend``): ``gloo`` (default) measures distlib's gloo backend, with torch's
gloo and raw mpi4py beside it; ``mpi`` measures distlib's mpi backend under mpirun against raw
mpi4py on the same buffers in the same processes (the floor: distlib's overhead is the
difference), with distlib's gloo and torch's gloo beside them.

What is measured, and why this way:

* **N local ranks** (``--nproc``), forked once per implementation and kept for the whole sweep
  (one distlib group, one torch gloo group; env:// rendezvous on 127.0.0.1). Setting up a group
  per size would measure connection set-up, not the collective. The groups never run at the
  same time: the idle ones block in a pipe read. The MPI implementations (distlib's mpi
  backend, raw mpi4py) run in one job of N ranks under mpirun instead (bench/mpi_group.py,
  bench/mpi_ranks.py), driven over a socket, idle the same way.
* **Per op and size** (``--ops``; sizes ``--min-bytes`` .. ``--max-bytes`` by ``--step-factor``):
  ``--warmup`` untimed ops, a barrier, then ``--iters`` back-to-back ops; each rank reports its
  mean time per op and the row's time is the **maximum over ranks**, as nccl-tests does (a
  collective is as slow as its slowest rank).
* **Interleaved rounds** (``--rounds``): for each size, distlib then each reference, round
  after round, so a slow phase of a noisy machine hits all; the table shows the median over
  rounds.
* **Validation**: in the first round of every size each rank fills its buffers with a
  position-dependent pattern (period 251, different per rank and per chunk), runs the op once
  and checks every element of the result, so a broken run cannot report a bandwidth: a row
  that fails the check shows WRONG and no figures. The timed ops then run on zeroed buffers
  (repeated in-place sums would otherwise grow to inf).
* **Sizes as nccl-tests defines them**: all_reduce, broadcast and reduce: the buffer each rank
  holds; all_gather_into_tensor: the gathered output; reduce_scatter_tensor: the input that is
  scattered; all_to_all_single: what each rank sends in all. Sizes are rounded down to whole
  elements (and, for the chunked ops, to a multiple of N elements, one element per rank at
  least). ``algbw = size / time``; ``busbw = algbw x factor``, with factor 2(n-1)/n for
  all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast and
  reduce: the factor that makes busbw comparable to the hardware's link bandwidth whatever the
  op and N.
* **init**: ``init_process_group("gloo")`` over env:// at the world sizes of ``--init-sizes``
  (default 8 and 32); all ranks start at one instant and the time is until the last returns.
  Then one all_reduce checks the group works (untimed).
* ``--transport tcp`` sets ``DISTLIB_SHM=0`` in the children (distlib's same-host shared
  memory off: every byte over TCP, as torch's gloo moves it); the default ``shm`` lets distlib
  use shared memory for large all_reduce when all ranks are on this host (they are).

Targets, shown as PASS/MISS, are in ``targets.json``, section ``collectives``: all_reduce busbw
at one size and dtype for some world sizes (a bound per transport), the small all_reduce's
latency, and init_process_group at two world sizes (relative to torch, and absolute); section
``collectives_mpi`` for ``--backend mpi``: the same busbw and latency rows against raw mpi4py
(no init rows: mpirun sets ranks up before distlib runs).

The "ratio" of a row is how many times better distlib is than the reference (torch for gloo,
raw mpi4py for mpi): distlib busbw / reference busbw, which for one size is reference time /
distlib time. With ``--backend mpi`` the "overhead" column is distlib's time minus mpi4py's.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from distlib.net import raise_fd_limit
from .. import command
from ..command import ToolError
from ..sizes import format_size, parse_size
from ..store_service import free_port
from . import common, mpi_group
from .cases import CHUNKED, Case, measure
from .common import _CTX, BenchError, Child, Printer, Row, Table, Target, fmt_num, fmt_seconds, fmt_speedup, sleep_until

DISTLIB, TORCH = common.DISTLIB, common.TORCH
#: Raw mpi4py (the floor) and, with --backend mpi, distlib's gloo backend beside its mpi backend.
MPI4PY, DISTLIB_GLOO = "mpi4py", "distlib-gloo"
BACKENDS = ("gloo", "mpi", "nccl")
#: Short names of the implementations in the tables' headers.
SHORT = {TORCH: "torch", MPI4PY: "mpi4py", DISTLIB_GLOO: "gloo"}

#: Ops the benchmark knows, in the order tables print. The sizing word says what "size" means.
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all_single")
DEFAULT_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single")
#: Short names people type (nccl-tests' binaries are all_gather_perf, reduce_scatter_perf, alltoall_perf).
ALIASES = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
           "all_to_all": "all_to_all_single", "alltoall": "all_to_all_single", "allreduce": "all_reduce",
           "allgather": "all_gather_into_tensor", "reducescatter": "reduce_scatter_tensor"}
#: What the size column means, per op (printed above each table).
SIZE_MEANS = {
    "all_reduce": "size = each rank's buffer",
    "broadcast": "size = the buffer, from rank 0",
    "reduce": "size = each rank's buffer, to rank 0",
    "all_gather_into_tensor": "size = the gathered output",
    "reduce_scatter_tensor": "size = the input that is scattered",
    "all_to_all_single": "size = what each rank sends in all",
}
#: numpy dtypes both implementations move and sum (bool and complex are left out: MIN/MAX and
#: torch's gloo support differ).
DTYPES = ("float32", "float64", "float16", "int8", "uint8", "int32", "int64")

MIB = 1 << 20

#: The targets (targets.json) and the rows they apply to.
TARGETS = common.load_targets("collectives")
BUSBW = TARGETS["all_reduce_busbw"]
INIT_RELATIVE_WS = TARGETS["init_relative"]["applies"]["ranks"]
INIT_ABSOLUTE_WS = TARGETS["init_absolute"]["applies"]["ranks"]
#: --backend mpi: the same all_reduce rows against raw mpi4py.
TARGETS_MPI = common.load_targets("collectives_mpi")


def busbw_factor(op: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: what busbw multiplies algbw by, so that busbw is the
    bandwidth each rank's link carries (an all_reduce moves 2(n-1)/n of its buffer per rank)."""
    n = nranks
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in CHUNKED:
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def op_size(op: str, nbytes: int, itemsize: int, nranks: int) -> Tuple[int, int]:
    """(bytes, count) that a requested size becomes for ``op``: whole elements, at least one;
    for the chunked ops a multiple of N elements (one chunk per rank, one element at least)."""
    count = max(1, nbytes // itemsize)
    if op in CHUNKED:
        count = max(1, count // nranks) * nranks
    return count * itemsize, count


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> List[int]:
    """min, min*f, min*f^2, ... up to max inclusive (nccl-tests' -b/-e/-f)."""
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def _finite(x: Optional[float]) -> Optional[float]:
    """x for JSON: None for NaN/inf (not measured, failed)."""
    return None if x is None or math.isnan(x) or math.isinf(x) else x


def _fmt_gbs(x: float) -> str:
    """GB/s with two decimals, as nccl-tests prints them."""
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


def algbw_gbs(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes, as nccl-tests)."""
    if not seconds or seconds <= 0 or math.isnan(seconds):
        return float("nan")
    return nbytes / seconds / 1e9


# -- what runs in a rank ------------------------------------------------------------------------


def _child_env(env: Dict[str, str], rank: int, world: int, port: int) -> None:
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

        return getattr(world.default_pg.backend_for("cpu"), "shm_state", None)
    except Exception:  # noqa: BLE001 - informative only
        return None


def _rank_child(conn, impl: str, rank: int, world: int, port: int, env: Dict[str, str],
                timeout_s: float) -> Dict[str, Any]:
    """One rank of a measuring group: init, then serve ("measure", ...) until "stop"."""
    _child_env(env, rank, world, port)
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


def _init_child(conn, impl: str, rank: int, world: int, port: int, env: Dict[str, str], go, start_at,
                timeout_s: float) -> Dict[str, Any]:
    """One rank of an init measurement: wait for the common start instant, init, check the
    group with one all_reduce (untimed), destroy."""
    _child_env(env, rank, world, port)
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


class _Group:
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


@dataclass
class _Point:
    """One (op, size) of the sweep and its row."""

    op: str
    nbytes: int
    count: int
    row: Row
    validated: Dict[str, Optional[bool]]


class CollectivesBench:
    def __init__(self, args: argparse.Namespace, impls: Sequence[str], say: Printer):
        self.args = args
        self.impls = list(impls)
        self.say = say
        self.n = args.nproc
        self.mpi = args.backend == "mpi"
        #: what the ratio and the targets compare distlib with
        self.reference = MPI4PY if self.mpi else TORCH
        self.targets_spec = TARGETS_MPI if self.mpi else TARGETS
        self.mpi_library = ""  # the MPI library's version, once the MPI job has started
        self.env = {"DISTLIB_SHM": "0" if args.transport == "tcp" else "1"}
        self.points: List[_Point] = []
        self.init_rows: List[Row] = []
        self.targets: List[Tuple[str, Row]] = []  # (label, row): rows with a target, in print order
        self.failures: List[str] = []
        self.shm_used: Optional[str] = None
        import numpy as np

        self.itemsize = np.dtype(args.dtype).itemsize

    # -- collectives -----------------------------------------------------------------------------

    def _plan(self) -> None:
        """The (op, size) points, deduplicated after rounding, with their rows and targets."""
        for op in self.args.ops:
            seen = set()
            for requested in size_sweep(self.args.min_bytes, self.args.max_bytes, self.args.step_factor):
                nbytes, count = op_size(op, requested, self.itemsize, self.n)
                if nbytes in seen:
                    continue
                seen.add(nbytes)
                row = Row(op, f"{nbytes} B", "s", False)
                self.points.append(_Point(op, nbytes, count, row, {}))

    def _busbw_target(self) -> Target:
        if self.mpi:
            return TARGETS_MPI["all_reduce_busbw"]["target"]
        return BUSBW[self.args.transport]

    def _add_targets(self) -> None:
        """Target rows point at the sweep's rows when the run measured them; otherwise an empty
        row stands in (n/a) and says why."""
        def find(op: str, nbytes: int) -> Optional[Row]:
            for p in self.points:
                if p.op == op and p.nbytes == nbytes:
                    return p.row
            return None

        busbw = self.targets_spec["all_reduce_busbw"]["applies"]
        if self.n in busbw["ranks"]:
            size = format_size(busbw["bytes"])
            label = f"all_reduce {busbw['dtype']} {size} busbw, {self.n} ranks" + \
                ("" if self.mpi else f", {self.args.transport}")
            row = find("all_reduce", busbw["bytes"]) if self.args.dtype == busbw["dtype"] else None
            if row is None:
                row = Row("targets", label, "s", False,
                          note=f"not in this run (needs {busbw['dtype']} and {size} in the sizes)")
            row.target = self._busbw_target()
            self.targets.append((label, row))
        latency = self.targets_spec["all_reduce_latency"]
        label = f"all_reduce {format_size(latency['applies']['bytes'])} latency, {self.n} ranks"
        row = find("all_reduce", latency["applies"]["bytes"]) if self.itemsize <= latency["applies"]["bytes"] else None
        if row is None:
            row = Row("targets", label, "s", False,
                      note=f"not in this run (needs a {latency['applies']['bytes']}-byte all_reduce)")
        row.target = latency["target"]
        self.targets.append((label, row))

    def _group_key(self, impl: str) -> str:
        """Which group runs ``impl``: the MPI job runs raw mpi4py and distlib's mpi backend."""
        return "mpi" if impl == MPI4PY or (impl == DISTLIB and self.mpi) else impl

    def _start_group(self, key: str):
        """The ranks that serve the sweep for group ``key`` (see _group_key; collectives_cuda
        starts GPU ranks instead)."""
        if key == "mpi":
            impls = [i for i in self.impls if self._group_key(i) == "mpi"]
            group = mpi_group.MpiGroup(self.n, impls, self.args.timeout)
            self.mpi_library = group.library
            return group
        n, env, timeout = self.n, self.env, self.args.timeout
        return _Group(key, n, timeout, lambda r, port: Child(_rank_child, key, r, n, port, env, timeout,
                                                             name=f"{key}-rank-{r}"))

    def collectives(self) -> None:
        self._plan()
        self._add_targets()
        if not self.points:
            return
        groups: Dict[str, Any] = {}  # group key (_group_key) -> its running group, or None
        dead: Dict[str, str] = {}  # group key -> why its group could not be (re)started
        unsupported: Dict[Tuple[str, str], str] = {}  # (impl, op) -> error
        args = self.args
        try:
            for point in self.points:
                self.say(f"  {point.op} {point.nbytes} B ...")
                for _rnd, impl in common.interleaved(args.rounds, self.impls):
                    row = point.row
                    key = self._group_key(impl)
                    if key in dead:
                        row.fail(impl, dead[key])
                        continue
                    if (impl, point.op) in unsupported:
                        row.fail(impl, unsupported[(impl, point.op)])
                        continue
                    if impl in row.errors:
                        continue
                    if groups.get(key) is None:
                        try:
                            self.say(f"  starting {self.n} {key} ranks ...")
                            groups[key] = self._start_group(key)
                        except BenchError as exc:
                            dead[key] = f"{self.n} {key} ranks did not start: {str(exc).splitlines()[0]}"
                            self.failures.append(f"{dead[key]}\n{exc}")
                            row.fail(impl, dead[key])
                            continue
                    group = groups[key]
                    validate = impl not in point.validated  # once per size, the first time it runs
                    try:
                        replies = group.measure(impl, point.op, point.count, args.dtype, args.iters, args.warmup,
                                                validate)
                    except BenchError as exc:
                        # a rank failed or hung: this group is unusable; a fresh one for what follows
                        why = str(exc).splitlines()[0]
                        self.failures.append(f"{point.op} {point.nbytes} B, {impl}: {exc}")
                        row.fail(impl, why)
                        group.stop()
                        groups[key] = None
                        continue
                    errors = [r["error"] for r in replies if r.get("error")]
                    if errors:  # raised on the ranks (e.g. an op this torch's gloo lacks): not retried
                        unsupported[(impl, point.op)] = errors[0]
                        row.fail(impl, errors[0])
                        self.failures.append(f"{point.op} {point.nbytes} B, {impl}: {errors[0]}")
                        continue
                    if validate:
                        wrong = [r["wrong"] for r in replies if r.get("wrong")]
                        point.validated[impl] = not wrong
                        if wrong:
                            row.fail(impl, "WRONG: " + wrong[0])
                            self.failures.append(f"{point.op} {point.nbytes} B, {impl}: wrong result: {wrong[0]}")
                            continue
                    if impl == (DISTLIB_GLOO if self.mpi else DISTLIB) and point.op == "all_reduce":
                        self.shm_used = replies[0].get("shm") or self.shm_used
                    per_rank = [r["mean_s"] for r in replies]
                    row.add(impl, max(per_rank), per_rank_us=[round(t * 1e6, 3) for t in per_rank])
        finally:
            for group in groups.values():
                if group is not None:
                    group.stop()

    # -- init ------------------------------------------------------------------------------------

    def init(self) -> None:
        for ws in self.args.init_sizes:
            target = None
            if ws == INIT_RELATIVE_WS:
                target = TARGETS["init_relative"]["target"]
            elif ws == INIT_ABSOLUTE_WS:
                target = TARGETS["init_absolute"]["target"]
            row = Row("init", f"init_process_group, {ws} ranks", "s", False, target)
            self.init_rows.append(row)
            if target is not None:
                self.targets.append((row.name, row))
            for rnd, impl in common.interleaved(self.args.rounds, self.impls):
                if impl in row.errors:
                    continue
                self.say(f"  init_process_group at {ws} ranks, round {rnd + 1}, {impl} ...")
                try:
                    row.add(impl, self._init_once(impl, ws))
                except BenchError as exc:
                    row.fail(impl, str(exc).splitlines()[0])
                    self.failures.append(f"init at {ws} ranks, {impl}: {exc}")

    def _init_once(self, impl: str, ws: int) -> float:
        raise_fd_limit()
        port = free_port()
        go = _CTX.Event()
        start_at = _CTX.Value("d", 0.0, lock=False)
        timeout = self.args.timeout
        kids: List[Child] = []
        try:
            for r in range(ws):
                kids.append(Child(_init_child, impl, r, ws, port, self.env, go, start_at, timeout,
                                  name=f"{impl}-init-rank-{r}"))
            for kid in kids:
                kid.recv(timeout)
            start_at.value = time.perf_counter() + 0.1
            go.set()
            results = [kid.result(timeout) for kid in kids]
        finally:
            for kid in kids:
                kid.stop()
        return max(r["t1"] for r in results) - min(r["t0"] for r in results)

    # -- output ----------------------------------------------------------------------------------

    def _impl_figures(self, point: _Point, impl: str) -> Dict[str, Any]:
        row = point.row
        t = row.median(impl) if impl in row.values and impl not in row.errors else float("nan")
        alg = algbw_gbs(point.nbytes, t)
        factor = busbw_factor(point.op, self.n)
        return {"time_s": t, "algbw": alg, "busbw": alg * factor if not math.isnan(alg) else float("nan")}

    def op_tables(self) -> List[str]:
        """One nccl-tests-style table per op: size, count, type, time, algbw, busbw (distlib),
        then each other implementation's time and busbw (the reference's followed by the ratio,
        and with --backend mpi distlib's overhead over it), then whether results were checked."""
        others = [impl for impl in self.impls if impl != DISTLIB]
        out = []
        for op in self.args.ops:
            points = [p for p in self.points if p.op == op]
            if not points:
                continue
            factor = busbw_factor(op, self.n)
            headers = ["size (B)", "count", "type", "time (us)", "algbw (GB/s)", "busbw (GB/s)"]
            for impl in others:
                headers += [f"{SHORT[impl]} (us)", f"{SHORT[impl]} busbw"]
                if impl == self.reference:
                    headers += ["ratio"] + (["overhead (us)"] if self.mpi else [])
            headers.append("check")
            table = Table(headers, "rrl" + "r" * (len(headers) - 4) + "l")
            busbws: Dict[str, List[float]] = {impl: [] for impl in self.impls}
            for p in points:
                cells: List[str] = [str(p.nbytes), str(p.count), self.args.dtype]
                problems = []
                for impl in self.impls:
                    if impl in p.row.errors:
                        word = "WRONG" if p.row.errors[impl].startswith("WRONG") else "FAILED"
                        problems.append(f"{SHORT.get(impl, impl)} {word}")
                        figs = [word, "-", "-"] if impl == DISTLIB else [word, "-"]
                    else:
                        fig = self._impl_figures(p, impl)
                        if not math.isnan(fig["busbw"]):
                            busbws[impl].append(fig["busbw"])
                        figs = [fmt_num(fig["time_s"] * 1e6), _fmt_gbs(fig["algbw"]), _fmt_gbs(fig["busbw"])]
                        if impl != DISTLIB:
                            figs = [figs[0], figs[2]]
                    cells += figs
                    if impl == self.reference:
                        cells.append(fmt_speedup(p.row.speedup(DISTLIB, self.reference)))
                        if self.mpi:
                            cells.append(fmt_num(p.row.excess(DISTLIB, self.reference) * 1e6))
                if problems:
                    cells.append(", ".join(problems))
                else:
                    cells.append("ok" if all(p.validated.get(impl) for impl in self.impls) else "-")
                table.add(*cells)
            avg = "; ".join(f"{impl} {sum(v) / len(v):.2f} GB/s" for impl, v in busbws.items() if v)
            title = (f"{op}{' (sum)' if op in ('all_reduce', 'reduce', 'reduce_scatter_tensor') else ''}, "
                     f"{self.args.dtype}, {self.n} ranks; {SIZE_MEANS[op]}; busbw = algbw x {factor:.3g}")
            out.append(f"{title}\n{table.render()}\navg busbw over sizes: {avg or '-'}")
        return out

    def _value_text(self, row: Row, impl: str) -> str:
        """A target row's figure: busbw for the bandwidth target, a time otherwise."""
        if impl in row.errors:
            return "WRONG" if row.errors[impl].startswith("WRONG") else "FAILED"
        value = row.median(impl)
        if math.isnan(value):
            return "-"
        busbw_bytes = self.targets_spec["all_reduce_busbw"]["applies"]["bytes"]
        if row.section == "all_reduce" and row.name == f"{busbw_bytes} B":
            return f"{algbw_gbs(busbw_bytes, value) * busbw_factor('all_reduce', self.n):.2f} GB/s"
        return fmt_seconds(value)

    def _row_table(self, labelled: Sequence[Tuple[str, Row]], first: str) -> str:
        ref = self.reference
        has_ref = ref in self.impls
        headers = [first, "distlib"] + ([SHORT[ref], "ratio"] if has_ref else []) + \
            (["overhead"] if has_ref and self.mpi else []) + ["target", "result"]
        table = Table(headers, "lr" + "r" * (len(headers) - 4) + "ll")
        for label, row in labelled:
            result = row.result(DISTLIB, ref) if row.target else ""
            if result == common.NOT_MEASURED:
                result = f"n/a (no {SHORT[ref]})" if not has_ref and row.values.get(DISTLIB) else "n/a"
            if row.note:
                result += f": {row.note}"
            cells = [label, self._value_text(row, DISTLIB)]
            if has_ref:
                cells += [self._value_text(row, ref), fmt_speedup(row.speedup(DISTLIB, ref))]
                if self.mpi:
                    excess = row.excess(DISTLIB, ref)
                    cells.append("-" if math.isnan(excess) else ("+" if excess >= 0 else "-") + fmt_seconds(abs(excess)))
            cells += [row.target.text if row.target else "", result]
            table.add(*cells)
        return table.render()

    def init_table(self) -> Optional[str]:
        if not self.init_rows:
            return None
        return self._row_table([(r.name, r) for r in self.init_rows], "init (env://, all ranks start together)")

    def targets_table(self) -> Optional[str]:
        if not self.targets:
            return None
        return self._row_table(self.targets, "target")

    def summary(self) -> Dict[str, int]:
        counts = {common.PASS: 0, common.MISS: 0, common.NOT_MEASURED: 0}
        for _, row in self.targets:
            counts[row.result(DISTLIB, self.reference)] += 1
        return counts

    def collectives_json(self) -> List[Dict[str, Any]]:
        out = []
        for p in self.points:
            entry: Dict[str, Any] = {
                "op": p.op, "bytes": p.nbytes, "count": p.count, "dtype": self.args.dtype, "ranks": self.n,
                "busbw_factor": busbw_factor(p.op, self.n),
            }
            for impl in self.impls:
                fig = self._impl_figures(p, impl)
                entry[impl] = {  # unrounded, so busbw can be recomputed from bytes and time_us
                    "time_us": _finite(fig["time_s"] * 1e6),
                    "algbw_gbs": _finite(fig["algbw"]),
                    "busbw_gbs": _finite(fig["busbw"]),
                    "rounds_us": [round(v * 1e6, 3) for v in p.row.values.get(impl, [])],
                    "per_rank_us": [d.get("per_rank_us") for d in p.row.details.get(impl, [])],
                    "validated": p.validated.get(impl),
                    "error": p.row.errors.get(impl),
                }
            has_ref = self.reference in self.impls
            entry["ratio"] = _finite(p.row.speedup(DISTLIB, self.reference)) if has_ref else None
            if self.mpi:
                entry["overhead_us"] = _finite(p.row.excess(DISTLIB, self.reference) * 1e6) if has_ref else None
            out.append(entry)
        return out


# -- command line -------------------------------------------------------------------------------

def parse_bytes(text: str) -> int:
    """4, 4B, 64K, 64KiB, 64M, 1G (binary units, as nccl-tests' -b/-e)."""
    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 4, 64K, 64M or 1G; got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive; got {text!r}")
    return value


def _ops(text: str) -> List[str]:
    names = [x for x in text.replace(" ", "").split(",") if x]
    out: List[str] = []
    for name in names:
        name = ALIASES.get(name, name)
        if name not in OPS:
            raise argparse.ArgumentTypeError(f"unknown op {name!r}; ops are {', '.join(OPS)} "
                                             f"(or {', '.join(sorted(ALIASES))})")
        if name not in out:
            out.append(name)
    if not out:
        raise argparse.ArgumentTypeError("no ops given")
    return out


def _init_sizes(text: str) -> List[int]:
    if text.strip().lower() in ("", "none", "0"):
        return []
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated world sizes or 'none'; got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1; got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distlib bench collectives",
        description="Collective bandwidth and latency in the style of nccl-tests (size, count, type, time, algbw, "
                    "busbw), and init_process_group time; side by side with torch's gloo when it is importable "
                    "and raw mpi4py (the floor) when mpi4py and mpirun are there. --backend mpi starts its ranks "
                    "under mpirun itself.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="distlib's backend to measure: gloo (the default on cpu: forked ranks, torch's gloo and raw "
                        "mpi4py beside it), mpi (ranks under mpirun, with raw mpi4py on the same buffers; distlib's "
                        "and torch's gloo beside them), or with --device cuda nccl (its default) or gloo")
    p.add_argument("--nproc", type=int, default=2, help="ranks (local processes) of the measured group")
    p.add_argument("--ops", type=_ops, default=list(DEFAULT_OPS),
                   help=f"comma-separated, of {','.join(OPS)}")
    p.add_argument("--min-bytes", "-b", type=parse_bytes, default=4, help="smallest size (4, 64K, 1M ...)")
    p.add_argument("--max-bytes", "-e", type=parse_bytes, default=64 * MIB, help="largest size")
    p.add_argument("--step-factor", "-f", type=int, default=4, help="each size is the previous one times this")
    p.add_argument("--iters", "-n", type=int, default=20, help="timed ops per size (back to back)")
    p.add_argument("--warmup", "-w", type=int, default=5, help="untimed ops per size before the barrier")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per size, interleaved between implementations; the median is shown")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="element type")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: cupy arrays on GPUs against torch's CUDA tensors, nccl (default) or gloo "
                        "(--backend); its defaults: 8 B .. 256 MiB, no init measurement (docs/collectives.md)")
    p.add_argument("--transport", choices=("shm", "tcp"), default="shm",
                   help="shm: distlib may use same-host shared memory for large all_reduce; tcp: DISTLIB_SHM=0 in "
                        "the children, every byte over TCP (torch's gloo always uses TCP)")
    p.add_argument("--init-sizes", type=_init_sizes, default=None, metavar="N,N",
                   help=f"world sizes at which to time init_process_group('gloo') ('none' to skip; default "
                        f"{INIT_RELATIVE_WS},{INIT_ABSOLUTE_WS}, none with --backend mpi)")
    p.add_argument("--no-torch", action="store_true", help="leave torch's gloo out, even if torch is importable")
    p.add_argument("--no-mpi4py", action="store_true", help="leave raw mpi4py (the floor) out, even if it can run")
    p.add_argument("--no-gloo", action="store_true",
                   help="--backend mpi: leave distlib's gloo (and torch's) out; mpi and raw mpi4py only")
    command.add_json(p)
    p.add_argument("--plot", metavar="FILE.png", help="also plot busbw against size (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any wait on a rank may take (start, one size, init); also the groups' timeout")
    p.add_argument("--fail-on-miss", action="store_true", help="exit 1 when a measured target is missed")
    command.add_quiet(p)
    command.add_log_level(p)
    return p


def _check_args(args: argparse.Namespace) -> Optional[str]:
    """The first thing wrong with the options, in words; None if they make sense."""
    if args.nproc < 2:
        return f"--nproc must be at least 2 (a collective needs two ranks); got {args.nproc}"
    if args.nproc > 512:
        return f"--nproc {args.nproc}: at most 512 local processes"
    if args.min_bytes > args.max_bytes:
        return f"--min-bytes ({args.min_bytes}) is larger than --max-bytes ({args.max_bytes})"
    if args.step_factor < 2:
        return f"--step-factor must be at least 2; got {args.step_factor}"
    if args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        return "--iters and --rounds must be >= 1, --warmup >= 0"
    if args.timeout <= 0:
        return "--timeout must be positive"
    if under_mpirun():
        return ("distlib bench collectives starts its ranks itself (with --backend mpi under mpirun): run it "
                "without mpirun")
    if args.backend == "mpi":
        missing = mpi_group.why_not_available()
        if missing:
            return f"--backend mpi needs mpi4py and mpirun: {missing} (pip install 'distlib-c10d[mpi]')"
        if args.init_sizes:
            return ("--init-sizes times init_process_group('gloo'); with --backend mpi, mpirun sets the ranks up "
                    "before distlib runs: leave it out")
    elif args.no_gloo:
        return "--no-gloo leaves distlib's gloo out of a --backend mpi run; with --backend gloo it is what is measured"
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            return ("--plot needs matplotlib, which is not importable here "
                    "(pip install 'distlib-c10d[plot]', or leave out --plot)")
        directory = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(directory):
            return f"--plot {args.plot}: directory {directory} does not exist"
    return None


def under_mpirun() -> bool:
    """Whether this process is a rank of an MPI job (Open MPI's, PMIx's or MPICH's variables)."""
    return any(os.environ.get(name) for name in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"))


def write_plot(path: str, bench: CollectivesBench) -> None:
    """busbw against size, one line per op and implementation (torch dashed, mpi4py dotted, distlib's
    gloo beside its mpi backend dash-dotted), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, op in enumerate(bench.args.ops):
        points = [p for p in bench.points if p.op == op]
        for impl, style in ((DISTLIB, "-"), (TORCH, "--"), (MPI4PY, ":"), (DISTLIB_GLOO, "-.")):
            if impl not in bench.impls:
                continue
            xs, ys = [], []
            for p in points:
                bw = bench._impl_figures(p, impl)["busbw"]
                if not math.isnan(bw) and bw > 0:
                    xs.append(p.nbytes)
                    ys.append(bw)
            if xs:
                ax.plot(xs, ys, style, marker="o", markersize=3, color=colors[i % len(colors)], label=f"{op} ({impl})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"distlib bench collectives: backend {bench.args.backend}, {bench.n} ranks, {bench.args.dtype}, "
                 f"transport {bench.args.transport}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _preload_distlib() -> None:
    """Import what a rank's init uses, once in the parent, so that no forked rank pays for
    imports inside the timed init (torch is imported here too, for the same reason)."""
    import numpy  # noqa: F401

    from distlib import collectives, distributed  # noqa: F401
    from distlib.backends import gloo  # noqa: F401


def _implementations(args: argparse.Namespace) -> Tuple[List[str], Dict[str, str], Dict[str, str]]:
    """(what this run measures, in table order; their versions; why each one left out is). gloo:
    distlib, torch, mpi4py; mpi: distlib, mpi4py, distlib's gloo, torch."""
    mpi = args.backend == "mpi"
    no_torch = args.no_torch or (mpi and args.no_gloo)
    found, torch_version, torch_why = common.implementations(no_torch)
    why_not: Dict[str, str] = {}
    versions: Dict[str, str] = {}
    if TORCH in found:
        versions[TORCH] = torch_version
    else:
        why_not[TORCH] = "--no-gloo" if mpi and args.no_gloo else torch_why
    mpi4py_why = "--no-mpi4py" if args.no_mpi4py else mpi_group.why_not_available()
    if mpi4py_why:
        why_not[MPI4PY] = mpi4py_why
    else:
        from importlib.metadata import PackageNotFoundError, version

        try:
            versions[MPI4PY] = version("mpi4py")
        except PackageNotFoundError:
            versions[MPI4PY] = "?"
    impls = [DISTLIB]
    if mpi:
        impls += [MPI4PY] if MPI4PY in versions else []
        impls += [] if args.no_gloo else [DISTLIB_GLOO]
        impls += [TORCH] if TORCH in versions else []
    else:
        impls += [TORCH] if TORCH in versions else []
        impls += [MPI4PY] if MPI4PY in versions else []
    return impls, versions, why_not


def _describe_impl(impl: str, versions: Dict[str, str], mpi_library: str) -> str:
    if impl == TORCH:
        return f"torch {versions[TORCH]} gloo"
    if impl == MPI4PY:
        return f"raw mpi4py {versions[MPI4PY]}" + (f" on {mpi_library}" if mpi_library else "")
    return "distlib gloo"


def run(args: argparse.Namespace) -> int:
    """`distlib bench collectives` on host arrays (collectives_cli.main parses the options)."""
    if args.backend == "nccl":
        raise ToolError("--backend nccl runs on GPUs: add --device cuda", 2)
    args.backend = args.backend or "gloo"
    problem = _check_args(args)
    if problem:
        raise ToolError(problem, 2)
    say = Printer(args.quiet)

    _preload_distlib()
    mpi = args.backend == "mpi"
    if args.init_sizes is None:
        args.init_sizes = [] if mpi else [INIT_RELATIVE_WS, INIT_ABSOLUTE_WS]
    impls, versions, why_not = _implementations(args)
    raise_fd_limit()

    bench = CollectivesBench(args, impls, say)
    started = time.monotonic()
    say(f"distlib bench collectives: backend {args.backend}, {args.nproc} ranks, {', '.join(args.ops)}; "
        f"{args.min_bytes}..{args.max_bytes} B x{args.step_factor}; {args.rounds} round(s); transport "
        f"{args.transport}; " + "; ".join([f"{impl} {versions[impl]}" for impl in impls if impl in versions]
                                          + [f"{impl} not measured ({why})" for impl, why in why_not.items()]))
    try:
        bench.collectives()
        bench.init()
    except BenchError as exc:
        bench.failures.append(str(exc))
    wall = time.monotonic() - started

    env = common.environment({"transport": args.transport, "distlib_shm_all_reduce": bench.shm_used})
    shm_text = {"on": "used for all_reduce >= 256 KiB", "off": "off", "unset": "not needed (no large all_reduce)",
                None: "n/a"}.get(bench.shm_used, str(bench.shm_used))
    env["backend"] = args.backend
    env["mpi4py"] = versions.get(MPI4PY)
    env["mpi_library"] = bench.mpi_library or None
    compared = [_describe_impl(impl, versions, bench.mpi_library) for impl in impls[1:]]
    header = [
        f"distlib bench collectives: distlib {env['distlib']} ({args.backend} backend)"
        + (f" vs {'; '.join(compared)}" if compared else "")
        + "".join(f" ({SHORT.get(impl, impl)} not measured: {why})" for impl, why in why_not.items()),
        f"{env['nproc']} CPUs ({env['cpu_model']}), Python {env['python']}, {env['platform']}; "
        f"{args.nproc} local ranks; {args.iters} iters after {args.warmup} warmup; time = max over ranks of the "
        f"mean per op; median of {args.rounds} interleaved round(s); {wall:.0f} s",
        (f"transport: MPI's own for distlib mpi and mpi4py (one job under mpirun, the same buffers); "
         f"{args.transport} for distlib gloo (shared memory: {shm_text}); torch gloo over TCP" if mpi else
         f"transport: {args.transport} (distlib shared memory: {shm_text}; torch gloo over TCP"
         + ("; mpi4py: MPI's own, under mpirun)" if MPI4PY in impls else ")")),
    ]
    return finish(args, bench, impls, header, env, wall)


def finish(args: argparse.Namespace, bench: CollectivesBench, impls: Sequence[str], header: Sequence[str],
           env: Dict[str, Any], wall: float) -> int:
    """Print the header, the tables, the targets and the failures; write the plot and the JSON;
    the exit status (1 for a failure, or a miss under --fail-on-miss)."""
    out = command.text_stream(args.json)
    print("\n".join(header), file=out)
    for text in bench.op_tables():
        print(file=out)
        print(text, file=out)
    init = bench.init_table()
    if init:
        print(file=out)
        print(init, file=out)
    targets = bench.targets_table()
    if targets:
        print(file=out)
        print(targets, file=out)
    counts = bench.summary()
    print(file=out)
    ref = SHORT[bench.reference]
    print(f"ratio = how many times better distlib is (busbw distlib/{ref} = time {ref}/distlib)"
          + ("; overhead = distlib's time - raw mpi4py's (the floor)" if args.backend == "mpi" else "") + ". "
          f"targets: {counts[common.PASS]} PASS, {counts[common.MISS]} MISS"
          + (f", {counts[common.NOT_MEASURED]} not measured" if counts[common.NOT_MEASURED] else ""), file=out)
    for failure in bench.failures:
        print(f"FAILED: {failure}", file=out)
    out.flush()

    plot_error = None
    if args.plot:
        try:
            write_plot(args.plot, bench)
            print(f"plot: {args.plot}", file=out)
        except ImportError as exc:
            plot_error = f"--plot needs matplotlib, which could not be imported ({exc})"
        except OSError as exc:
            plot_error = f"--plot {args.plot}: {exc}"
        if plot_error:
            print(f"distlib bench collectives: {plot_error}", file=sys.stderr)

    if args.json:
        all_rows = [p.row for p in bench.points] + bench.init_rows
        all_rows += [r for _, r in bench.targets if all(r is not x for x in all_rows)]
        command.write_json(args.json, {
            "benchmark": "distlib bench collectives",
            "schema": 1,
            "environment": env,
            "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
            "backend": args.backend,
            "implementations": impls,
            "reference": bench.reference,
            "nproc": args.nproc,
            "collectives": bench.collectives_json(),
            "rows": [row.to_json(impls, bench.reference) for row in all_rows],
            "targets": [dict(row.to_json(impls, bench.reference), label=label) for label, row in bench.targets],
            "summary": counts,
            "failures": bench.failures,
            "wall_seconds": round(wall, 3),
        })
    if bench.failures or plot_error:
        return 1
    if args.fail_on_miss and counts[common.MISS]:
        return 1
    return 0
