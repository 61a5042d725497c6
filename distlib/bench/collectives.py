"""``distlib bench collectives``: an nccl-tests-style table of collective bandwidth and latency,
side by side with torch's gloo when torch is importable.

What is measured, and why this way:

* **N local ranks** (``--nproc``), forked once per implementation and kept for the whole sweep
  (one distlib group, one torch gloo group; env:// rendezvous on 127.0.0.1). Setting up a group
  per size would measure connection set-up, not the collective. The two groups never run at
  the same time: the idle one blocks in a pipe read.
* **Per op and size** (``--ops``; sizes ``--min-bytes`` .. ``--max-bytes`` by ``--step-factor``):
  ``--warmup`` untimed ops, a barrier, then ``--iters`` back-to-back ops; each rank reports its
  mean time per op and the row's time is the **maximum over ranks**, as nccl-tests does (a
  collective is as slow as its slowest rank).
* **Interleaved rounds** (``--rounds``): for each size, distlib then torch, round after round,
  so a slow phase of a noisy machine hits both; the table shows the median over rounds.
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

Targets (from the issue that asked for this benchmark), shown as PASS/MISS:

* all_reduce float32 64 MiB busbw, 2 and 4 ranks: >= 1x torch's gloo over TCP (``--transport
  tcp``), >= 2x with shared memory (``--transport shm``);
* 4-byte all_reduce latency: no worse than torch's (torch time / distlib time >= 1);
* init_process_group at 8 ranks: no slower than torch's; at 32 ranks: under 1 s.

The "ratio" of a row is how many times better distlib is: distlib busbw / torch busbw, which
for one size is torch time / distlib time.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..store.tcp.server import raise_fd_limit
from . import common
from .common import _CTX, BenchError, Child, Printer, Row, Table, Target, fmt_num, fmt_seconds, fmt_speedup, sleep_until

DISTLIB, TORCH = "distlib", "torch"

#: Ops the benchmark knows, in the order tables print. The sizing word says what "size" means.
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all_single")
DEFAULT_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single")
#: Short names people type (nccl-tests' binaries are all_gather_perf, reduce_scatter_perf, alltoall_perf).
ALIASES = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
           "all_to_all": "all_to_all_single", "alltoall": "all_to_all_single", "allreduce": "all_reduce",
           "allgather": "all_gather_into_tensor", "reducescatter": "reduce_scatter_tensor"}
#: Ops whose buffer is cut into one chunk per rank: sizes must be a multiple of N elements.
CHUNKED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
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

#: Validation pattern period: a prime, so chunk boundaries (multiples of count/N) never line
#: up with it and a chunk delivered to the wrong place shows.
PATTERN_PERIOD = 251
MIB = 1 << 20

#: Target rows. all_reduce 64 MiB: the issue sets these at 2 and 4 ranks.
BUSBW_TARGET_BYTES = 64 * MIB
BUSBW_TARGET_RANKS = (2, 4)
LATENCY_TARGET_BYTES = 4
INIT_RELATIVE_WS = 8
INIT_ABSOLUTE_WS, INIT_ABSOLUTE_LIMIT_S = 32, 1.0


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


def _pattern_period(np, dtype, offset: int, phase: int = 0):
    """One period of the validation pattern: ((phase + j) % P) + offset, cast to ``dtype``
    (integer casts wrap the same way on every rank, so expectations stay exact)."""
    j = (np.arange(PATTERN_PERIOD, dtype=np.int64) + phase) % PATTERN_PERIOD
    return (j + offset).astype(dtype)


def _tile(np, period, count: int, out=None):
    """``period`` repeated over ``count`` elements (into ``out`` when given): a broadcast
    assignment per whole period, so a 64 MiB pattern costs about a memcpy."""
    if out is None:
        out = np.empty(count, dtype=period.dtype)
    p = len(period)
    whole = count // p * p
    if whole:
        out[:whole].reshape(-1, p)[:] = period
    out[whole:] = period[: count - whole]
    return out


def _summed_period(np, dtype, offsets: Sequence[int], phase: int = 0):
    """The period of sum over ranks of their patterns, summed in ``dtype`` as a reduction
    would (wrapping for integers)."""
    acc = np.zeros(PATTERN_PERIOD, dtype=dtype)
    for off in offsets:
        acc = np.add(acc, _pattern_period(np, dtype, off, phase), dtype=dtype)
    return acc


class _Case:
    """One op at one size on one rank: its numpy buffers, how to fill them with the
    validation pattern, the call, and the check of the result.

    Buffers are numpy arrays; for torch they are wrapped with ``torch.from_numpy`` (shared
    memory), so the same fill and check code serves both implementations."""

    def __init__(self, op: str, count: int, dtype: str, rank: int, nranks: int):
        import numpy as np

        self.np = np
        self.op, self.count, self.rank, self.n = op, count, rank, nranks
        self.dtype = np.dtype(dtype)
        self.chunk = count // nranks if op in CHUNKED else count
        if op in ("all_reduce", "broadcast", "reduce"):
            self.buf = np.zeros(count, self.dtype)
        elif op == "all_gather_into_tensor":
            self.inp, self.out = np.zeros(self.chunk, self.dtype), np.zeros(count, self.dtype)
        elif op == "reduce_scatter_tensor":
            self.inp, self.out = np.zeros(count, self.dtype), np.zeros(self.chunk, self.dtype)
        elif op == "all_to_all_single":
            self.inp, self.out = np.zeros(count, self.dtype), np.zeros(count, self.dtype)
        else:
            raise ValueError(f"unknown op {op!r}")

    def bind(self, dist, wrap: Callable) -> Callable[[], Any]:
        """The call to time, on ``dist`` (distlib or torch.distributed)."""
        op = self.op
        if op == "all_reduce":
            b = wrap(self.buf)
            return lambda: dist.all_reduce(b)
        if op == "broadcast":
            b = wrap(self.buf)
            return lambda: dist.broadcast(b, 0)
        if op == "reduce":
            b = wrap(self.buf)
            return lambda: dist.reduce(b, 0)
        i, o = wrap(self.inp), wrap(self.out)
        fn = getattr(dist, op)
        return lambda: fn(o, i)

    def _offsets_a2a(self, src: int, dst: int) -> int:
        return 1 + src * self.n + dst

    def fill(self) -> None:
        np, dt, r, n, c = self.np, self.dtype, self.rank, self.n, self.chunk
        op = self.op
        if op in ("all_reduce", "reduce"):
            _tile(np, _pattern_period(np, dt, r + 1), self.count, self.buf)
        elif op == "broadcast":
            if r == 0:
                _tile(np, _pattern_period(np, dt, 1), self.count, self.buf)
            else:
                self.buf[:] = 0
        elif op == "all_gather_into_tensor":
            _tile(np, _pattern_period(np, dt, 7 * r + 1), c, self.inp)
            self.out[:] = 0
        elif op == "reduce_scatter_tensor":
            _tile(np, _pattern_period(np, dt, r + 1), self.count, self.inp)
            self.out[:] = 0
        else:  # all_to_all_single: chunk d of rank s carries (s, d)
            for d in range(n):
                _tile(np, _pattern_period(np, dt, self._offsets_a2a(r, d)), c, self.inp[d * c:(d + 1) * c])
            self.out[:] = 0

    def _same(self, got, want) -> bool:
        np = self.np
        if self.dtype.kind == "f" and self.op in ("all_reduce", "reduce", "reduce_scatter_tensor") \
                and self.dtype.itemsize < 4:
            # float16 sums past 2048 round, and the order of the sum may differ between ranks'
            # algorithms: allow the rounding, nothing more.
            return bool(np.allclose(got, want, rtol=2e-3 * self.n, atol=0))
        return bool(np.array_equal(got, want))

    def check(self) -> Optional[str]:
        """None if this rank's result is right; else what is wrong (the first bad index)."""
        np, dt, r, n, c = self.np, self.dtype, self.rank, self.n, self.chunk
        op = self.op
        expected: List[Tuple[str, Any, Any]] = []  # (what, got, want)
        if op in ("all_reduce", "reduce"):
            if op == "all_reduce" or r == 0:
                want = _tile(np, _summed_period(np, dt, [s + 1 for s in range(n)]), self.count)
                expected.append(("result", self.buf, want))
        elif op == "broadcast":
            expected.append(("result", self.buf, _tile(np, _pattern_period(np, dt, 1), self.count)))
        elif op == "all_gather_into_tensor":
            for s in range(n):
                expected.append((f"chunk from rank {s}", self.out[s * c:(s + 1) * c],
                                 _tile(np, _pattern_period(np, dt, 7 * s + 1), c)))
        elif op == "reduce_scatter_tensor":
            period = _summed_period(np, dt, [s + 1 for s in range(n)], phase=(r * c) % PATTERN_PERIOD)
            expected.append(("result", self.out, _tile(np, period, c)))
        else:
            for s in range(n):
                expected.append((f"chunk from rank {s}", self.out[s * c:(s + 1) * c],
                                 _tile(np, _pattern_period(np, dt, self._offsets_a2a(s, r)), c)))
        for what, got, want in expected:
            if not self._same(got, want):
                bad = np.flatnonzero(got != want)
                i = int(bad[0]) if len(bad) else -1
                return (f"rank {r}: {self.op} {what}: {len(bad)} of {len(want)} elements wrong; "
                        f"first at {i}: got {got[i]!r}, expected {want[i]!r}")
        return None

    def zero(self) -> None:
        for name in ("buf", "inp", "out"):
            arr = getattr(self, name, None)
            if arr is not None:
                arr[:] = 0


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
    if impl != DISTLIB:
        return None
    try:
        from ..group import world

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
    clock = time.perf_counter
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
            case = _Case(op, count, dtype, rank, world)
            call = case.bind(dist, wrap)
            if validate:
                case.fill()
                call()
                reply["wrong"] = case.check()
                case.zero()
            for _ in range(warmup):
                call()
            dist.barrier()
            t0 = clock()
            for _ in range(iters):
                call()
            reply["mean_s"] = (clock() - t0) / iters
            del call, case
        except Exception as exc:  # noqa: BLE001 - e.g. an op this torch's gloo lacks: reported per row
            reply["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        reply["shm"] = _shm_state(impl)
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT; rank 0 binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Group:
    """N rank children of one implementation, kept for the whole sweep."""

    def __init__(self, impl: str, nranks: int, env: Dict[str, str], timeout_s: float):
        self.impl, self.n, self.timeout_s = impl, nranks, timeout_s
        port = free_port()
        self.ranks: List[Child] = []
        try:
            for r in range(nranks):
                self.ranks.append(Child(_rank_child, impl, r, nranks, port, env, timeout_s,
                                        name=f"{impl}-rank-{r}"))
            for child in self.ranks:
                child.recv(timeout_s)
        except BaseException:
            self.stop()
            raise

    def measure(self, op: str, count: int, dtype: str, iters: int, warmup: int, validate: bool) -> List[Dict]:
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
        if self.args.transport == "shm":
            return Target(">= 2x torch (shm)", min_speedup=2.0)
        return Target(">= 1x torch (tcp)", min_speedup=1.0)

    def _add_targets(self) -> None:
        """Target rows point at the sweep's rows when the run measured them; otherwise an empty
        row stands in (n/a) and says why."""
        def find(op: str, nbytes: int) -> Optional[Row]:
            for p in self.points:
                if p.op == op and p.nbytes == nbytes:
                    return p.row
            return None

        if self.n in BUSBW_TARGET_RANKS:
            label = f"all_reduce float32 64 MiB busbw, {self.n} ranks, {self.args.transport}"
            row = find("all_reduce", BUSBW_TARGET_BYTES) if self.args.dtype == "float32" else None
            if row is None:
                row = Row("targets", label, "s", False, note="not in this run (needs float32 and 64 MiB in the sizes)")
            row.target = self._busbw_target()
            self.targets.append((label, row))
        label = f"all_reduce 4 B latency, {self.n} ranks"
        row = find("all_reduce", LATENCY_TARGET_BYTES) if self.itemsize <= LATENCY_TARGET_BYTES else None
        if row is None:
            row = Row("targets", label, "s", False, note="not in this run (needs a 4-byte all_reduce)")
        row.target = Target(">= 1x torch", min_speedup=1.0)
        self.targets.append((label, row))

    def collectives(self) -> None:
        self._plan()
        self._add_targets()
        if not self.points:
            return
        groups: Dict[str, Optional[_Group]] = {}
        dead: Dict[str, str] = {}  # impl -> why its group could not be (re)started
        unsupported: Dict[Tuple[str, str], str] = {}  # (impl, op) -> error
        args = self.args
        try:
            for point in self.points:
                self.say(f"  {point.op} {point.nbytes} B ...")
                for _rnd, impl in common.interleaved(args.rounds, self.impls):
                    row = point.row
                    if impl in dead:
                        row.fail(impl, dead[impl])
                        continue
                    if (impl, point.op) in unsupported:
                        row.fail(impl, unsupported[(impl, point.op)])
                        continue
                    if impl in row.errors:
                        continue
                    if groups.get(impl) is None:
                        try:
                            self.say(f"  starting {self.n} {impl} ranks ...")
                            groups[impl] = _Group(impl, self.n, self.env, args.timeout)
                        except BenchError as exc:
                            dead[impl] = f"{self.n} {impl} ranks did not start: {str(exc).splitlines()[0]}"
                            self.failures.append(f"{dead[impl]}\n{exc}")
                            row.fail(impl, dead[impl])
                            continue
                    group = groups[impl]
                    validate = impl not in point.validated  # once per size, the first time it runs
                    try:
                        replies = group.measure(point.op, point.count, args.dtype, args.iters, args.warmup, validate)
                    except BenchError as exc:
                        # a rank failed or hung: this group is unusable; a fresh one for what follows
                        why = str(exc).splitlines()[0]
                        self.failures.append(f"{point.op} {point.nbytes} B, {impl}: {exc}")
                        row.fail(impl, why)
                        group.stop()
                        groups[impl] = None
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
                    if impl == DISTLIB and point.op == "all_reduce":
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
                target = Target("<= torch", min_speedup=1.0)
            elif ws == INIT_ABSOLUTE_WS:
                target = Target(f"< {INIT_ABSOLUTE_LIMIT_S:g} s", max_value=INIT_ABSOLUTE_LIMIT_S)
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
        then torch's time and busbw and the ratio, then whether the result was checked."""
        has_ref = TORCH in self.impls
        out = []
        for op in self.args.ops:
            points = [p for p in self.points if p.op == op]
            if not points:
                continue
            factor = busbw_factor(op, self.n)
            headers = ["size (B)", "count", "type", "time (us)", "algbw (GB/s)", "busbw (GB/s)"]
            if has_ref:
                headers += ["torch (us)", "torch busbw", "ratio"]
            headers.append("check")
            table = Table(headers, "rrl" + "r" * (len(headers) - 4) + "l")
            busbws: Dict[str, List[float]] = {impl: [] for impl in self.impls}
            for p in points:
                cells: List[str] = [str(p.nbytes), str(p.count), self.args.dtype]
                problems = []
                for impl in self.impls:
                    if impl in p.row.errors:
                        word = "WRONG" if p.row.errors[impl].startswith("WRONG") else "FAILED"
                        problems.append(f"{impl} {word}")
                        figs = [word, "-", "-"] if impl == DISTLIB else [word, "-"]
                    else:
                        fig = self._impl_figures(p, impl)
                        if not math.isnan(fig["busbw"]):
                            busbws[impl].append(fig["busbw"])
                        figs = [fmt_num(fig["time_s"] * 1e6), _fmt_gbs(fig["algbw"]), _fmt_gbs(fig["busbw"])]
                        if impl != DISTLIB:
                            figs = [figs[0], figs[2]]
                    cells += figs
                if has_ref:
                    cells.append(fmt_speedup(p.row.speedup()))
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
        if row.section == "all_reduce" and row.name == f"{BUSBW_TARGET_BYTES} B":
            return f"{algbw_gbs(BUSBW_TARGET_BYTES, value) * busbw_factor('all_reduce', self.n):.2f} GB/s"
        return fmt_seconds(value)

    def _row_table(self, labelled: Sequence[Tuple[str, Row]], first: str) -> str:
        has_ref = TORCH in self.impls
        headers = [first, "distlib"] + (["torch", "ratio"] if has_ref else []) + ["target", "result"]
        table = Table(headers, "lr" + ("rr" if has_ref else "") + "ll")
        for label, row in labelled:
            result = row.result() if row.target else ""
            if result == common.NOT_MEASURED:
                result = "n/a (no torch)" if not has_ref and row.values.get(DISTLIB) else "n/a"
            if row.note:
                result += f": {row.note}"
            cells = [label, self._value_text(row, DISTLIB)]
            if has_ref:
                cells += [self._value_text(row, TORCH), fmt_speedup(row.speedup())]
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
            counts[row.result()] += 1
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
            entry["ratio"] = _finite(p.row.speedup()) if TORCH in self.impls else None
            out.append(entry)
        return out


# -- command line -------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """4, 4B, 64K, 64KiB, 64M, 1G (binary units, as nccl-tests' -b/-e)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 4, 64K, 64M or 1G; got {text!r}")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
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
                    "busbw), and init_process_group time; side by side with torch's gloo when it is importable.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
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
    p.add_argument("--transport", choices=("shm", "tcp"), default="shm",
                   help="shm: distlib may use same-host shared memory for large all_reduce; tcp: DISTLIB_SHM=0 in "
                        "the children, every byte over TCP (torch's gloo always uses TCP)")
    p.add_argument("--init-sizes", type=_init_sizes, default=[INIT_RELATIVE_WS, INIT_ABSOLUTE_WS],
                   metavar="N,N", help="world sizes at which to time init_process_group ('none' to skip)")
    p.add_argument("--no-torch", action="store_true", help="measure distlib only, even if torch is importable")
    p.add_argument("--json", metavar="PATH|-", help="also write the results as JSON (- = stdout; the tables then go "
                                                    "to stderr)")
    p.add_argument("--plot", metavar="FILE.png", help="also plot busbw against size (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any wait on a rank may take (start, one size, init); also the groups' timeout")
    p.add_argument("--fail-on-miss", action="store_true", help="exit 1 when a measured target is missed")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
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
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            return ("--plot needs matplotlib, which is not importable here "
                    "(pip install 'distlib-c10d[plot]', or leave out --plot)")
        directory = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(directory):
            return f"--plot {args.plot}: directory {directory} does not exist"
    return None


def write_plot(path: str, bench: CollectivesBench) -> None:
    """busbw against size, one line per op and implementation (torch dashed), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, op in enumerate(bench.args.ops):
        points = [p for p in bench.points if p.op == op]
        for impl, style in ((DISTLIB, "-"), (TORCH, "--")):
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
    ax.set_title(f"distlib bench collectives: {bench.n} ranks, {bench.args.dtype}, transport {bench.args.transport}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _torch_importable() -> bool:
    try:
        import torch.distributed  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no torch here
        return False
    return True


def _preload_distlib() -> None:
    """Import what a rank's init uses, once in the parent, so that no forked rank pays for
    imports inside the timed init (torch is imported here too, for the same reason)."""
    import numpy  # noqa: F401

    from .. import collectives, distributed  # noqa: F401
    from ..backends import gloo  # noqa: F401


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = _check_args(args)
    if problem:
        print(f"distlib bench collectives: {problem}", file=sys.stderr)
        return 2
    out = sys.stderr if args.json == "-" else sys.stdout
    say = Printer(args.quiet)

    _preload_distlib()
    with_torch = not args.no_torch and _torch_importable()
    impls = [DISTLIB, TORCH] if with_torch else [DISTLIB]
    torch_version = sys.modules["torch"].__version__ if with_torch else None
    raise_fd_limit()

    bench = CollectivesBench(args, impls, say)
    started = time.monotonic()
    say(f"distlib bench collectives: {args.nproc} ranks, {', '.join(args.ops)}; {args.min_bytes}..{args.max_bytes} B "
        f"x{args.step_factor}; {args.rounds} round(s); transport {args.transport}; "
        + (f"torch {torch_version}" if with_torch else
           "torch not measured" + (" (--no-torch)" if args.no_torch else " (not importable)")))
    try:
        bench.collectives()
        bench.init()
    except BenchError as exc:
        bench.failures.append(str(exc))
    wall = time.monotonic() - started

    env = common.environment({"transport": args.transport, "distlib_shm_all_reduce": bench.shm_used})
    shm_text = {"on": "used for all_reduce >= 256 KiB", "off": "off", "unset": "not needed (no large all_reduce)",
                None: "n/a"}.get(bench.shm_used, str(bench.shm_used))
    header = [
        f"distlib bench collectives: distlib {env['distlib']}"
        + (f" vs torch {torch_version} gloo" if with_torch else
           " (torch not measured: --no-torch)" if args.no_torch else " (torch not measured: not importable)"),
        f"{env['nproc']} CPUs ({env['cpu_model']}), Python {env['python']}, {env['platform']}; "
        f"{args.nproc} local ranks; {args.iters} iters after {args.warmup} warmup; time = max over ranks of the "
        f"mean per op; median of {args.rounds} interleaved round(s); {wall:.0f} s",
        f"transport: {args.transport} (distlib shared memory: {shm_text}; torch gloo over TCP)",
    ]
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
    print("ratio = how many times better distlib is (busbw distlib/torch = time torch/distlib). "
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
        common.write_json(args.json, {
            "benchmark": "distlib bench collectives",
            "schema": 1,
            "environment": env,
            "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
            "implementations": impls,
            "nproc": args.nproc,
            "collectives": bench.collectives_json(),
            "rows": [row.to_json(impls) for row in all_rows],
            "targets": [dict(row.to_json(impls), label=label) for label, row in bench.targets],
            "summary": counts,
            "failures": bench.failures,
            "wall_seconds": round(wall, 3),
        })
    if bench.failures or plot_error:
        return 1
    if args.fail_on_miss and counts[common.MISS]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
