"""The measurements of ``distlib bench collectives`` (bench/collectives.py describes them):
``CollectivesBench`` plans the sweep and its targets, runs every (op, size) round by round
on groups of ranks kept for the whole sweep (collectives_ranks.py, or the MPI job of
mpi_group.py), and times init_process_group; collectives_report.py prints the results.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from distlib.net import raise_fd_limit
from distlib_deploy.sizes import format_size
from distlib.store_service import free_port
from . import mpi_group
from .children import FORK, BenchError, Child
from .collectives_ops import (BUSBW, DISTLIB_GLOO, INIT_ABSOLUTE_WS, INIT_RELATIVE_WS, MPI4PY, TARGETS, TARGETS_MPI,
                              SweepPoint, op_size, size_sweep)
from .collectives_ranks import RankGroup, init_child, rank_child
from .collectives_report import CollectivesReport
from .results import DISTLIB, TORCH, Row, Target
from .tables import Printer
from .timing import interleaved


class CollectivesBench(CollectivesReport):
    """The sweep (``collectives``) and the init measurement (``init``) of one run; the rows in
    ``points``, ``init_rows`` and ``targets``, printed by CollectivesReport."""

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
        self.points: List[SweepPoint] = []
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
                self.points.append(SweepPoint(op, nbytes, count, row, {}))

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
        return RankGroup(key, n, timeout, lambda r, port: Child(rank_child, key, r, n, port, env, timeout,
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
                for _rnd, impl in interleaved(args.rounds, self.impls):
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
            for rnd, impl in interleaved(self.args.rounds, self.impls):
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
        go = FORK.Event()
        start_at = FORK.Value("d", 0.0, lock=False)
        timeout = self.args.timeout
        kids: List[Child] = []
        try:
            for r in range(ws):
                kids.append(Child(init_child, impl, r, ws, port, self.env, go, start_at, timeout,
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
