"""``distlib bench collectives --device cuda``: the nccl-tests-style table of collectives.py on
GPU arrays, side by side with torch on CUDA tensors: distlib's nccl backend (cupy) against
torch's ProcessGroupNCCL, or (``--backend gloo``) distlib's gloo with cupy arrays against
torch's gloo with CUDA tensors. **Written without a GPU to run it on** (docs/collectives.md).

How it differs from the CPU run, and why:

* **The host waits for the GPU around the timed region.** A collective on GPU arrays returns
  once it is enqueued (torch's and distlib's alike), so each rank synchronises its device
  (``cudaDeviceSynchronize``: ``cupy.cuda.Device().synchronize()`` / ``torch.cuda.synchronize()``)
  after the warmup, again after the barrier, and after the last timed op; time = the slowest
  rank's mean per op, as on the CPU.
* **Validation** fills host buffers with the CPU run's pattern, copies them to the device, runs
  the op once, copies back and checks every element, so a wrong result shows WRONG, not a
  bandwidth.
* **One GPU per rank when there are enough; else ranks share one** (rank r on device r mod the
  device count). NCCL refuses two ranks of one communicator on one GPU unless each has its own
  ``NCCL_HOSTID`` (it then uses its socket transport, over loopback here): both implementations
  get the same variables, so the comparison stays the same library against itself.
* **The parent never touches CUDA**: the ranks are forked, and CUDA cannot be used in a child
  forked after the parent initialised it. What devices there are is asked in a forked probe;
  without one the command says so in one line and exits 1.
* **World size 1** is allowed (nccl-tests' single-GPU run: NCCL's copy path and the call
  overhead); its busbw is 0 by definition (factor 2(n-1)/n), so ratios come from the times.

* **The per-call rows** (nccl, all_reduce and 8 B in the sweep, a GPU per rank): the
  host's time per 8-byte all_reduce (ReduceOp.MAX, so the value stays checkable), 3,000 back
  to back (ended by a device synchronisation), and with 10 and with 10,000 in flight: the
  caller's stream is first held by a spinning kernel longer than the calls take, so every one
  of them is still queued when the next is issued ("held" says whether it was, to the end).

Targets (targets.json, section ``collectives_cuda``): nccl all_reduce float32 busbw at 256 MiB
at least 0.95x torch's nccl (1 and 2 ranks); at one rank, 8 B back to back at most 0.5x torch's
time per call; per call with 10,000 in flight at most 1.2x that with 10 (1 and 2 ranks); the
8-byte sweep row at 2 ranks (sharing a GPU: NCCL's sockets) at most 1.2x torch's time. gloo
with cupy arrays is reported against torch's gloo without a target.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from distlib.net import raise_fd_limit
from distlib.command import ToolError
from distlib_deploy.sizes import format_size
from . import collectives as cpu
from .cases import Case
from .children import BenchError, Child, run_child
from .collectives_measure import CollectivesBench
from .collectives_ops import MIB, SHORT, SweepPoint, algbw_gbs, busbw_factor, op_size
from .collectives_ranks import RankGroup, child_env, serve
from .collectives_report import finish
from .results import DISTLIB, TORCH, Row, implementations, load_targets
from .tables import Printer, Table, environment, fmt_seconds, fmt_speedup
from .timing import interleaved


TARGETS = load_targets("collectives_cuda")
BUSBW = TARGETS["nccl_busbw"]
LATENCY = TARGETS["nccl_latency"]
PER_CALL = TARGETS["nccl_call"]
DEPTH = TARGETS["nccl_depth"]
#: The per-call rows: calls back to back, and the depths measured in flight.
BACK_TO_BACK = PER_CALL["applies"]["calls"]
DEPTHS = tuple(DEPTH["applies"]["depths"])
#: How long a held stream spins per call issued behind it (far more than one call costs).
SPIN_PER_CALL_S = 300e-6
#: The sizes of the targets: always measured when within --min-bytes .. --max-bytes.
TARGET_SIZES = (LATENCY["applies"]["bytes"], BUSBW["applies"]["bytes"])

#: What --device cuda defaults to (the CPU run's defaults are 4 B .. 64 MiB and init at 8 and 32).
CUDA_DEFAULTS = {"min_bytes": 8, "max_bytes": 256 * MIB, "step_factor": 4, "init_sizes": []}


def set_defaults(parser: argparse.ArgumentParser) -> None:
    """The defaults of a --device cuda run (options given on the command line still win)."""
    parser.set_defaults(**CUDA_DEFAULTS)


def shared_gpu_env(rank: int) -> Dict[str, str]:
    """What lets ranks of one communicator share a GPU, for measuring only: each its own
    NCCL_HOSTID (NCCL then treats them as separate hosts: its socket transport, over loopback)."""
    return {"NCCL_HOSTID": f"distlib-bench-rank{rank}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def check_args(args: argparse.Namespace) -> Optional[str]:
    """The first thing wrong with a --device cuda command line; None if it makes sense."""
    if args.nproc < 1 or args.nproc > 64:
        return f"--nproc {args.nproc}: 1 to 64 ranks (one GPU each, or sharing the GPUs there are)"
    if args.transport != "shm":
        return "--transport is about distlib's CPU shared memory: leave it out with --device cuda"
    if args.init_sizes:
        return "--init-sizes measures gloo's init on the CPU: leave it out with --device cuda"
    return cpu.check_args(argparse.Namespace(**{**vars(args), "nproc": 2}))  # the CPU checks, but the ranks


def placement(rank: int, world: int, devices: int, backend: str) -> Tuple[int, Dict[str, str]]:
    """(the rank's GPU, the variables it gets): rank r on GPU r mod the devices; with nccl and
    more ranks than GPUs, each rank its own NCCL_HOSTID."""
    return rank % devices, (shared_gpu_env(rank) if backend == "nccl" and world > devices else {})


# -- what runs in a rank ------------------------------------------------------------------------


class _Device:
    """One implementation's view of the GPU: device buffers, copies, synchronisation."""

    def __init__(self, impl: str, index: int):
        self.impl, self.index = impl, index
        if impl == TORCH:
            import torch

            self.torch = torch
            torch.cuda.set_device(index)
        else:
            import cupy

            self.cupy = cupy
            cupy.cuda.Device(index).use()

    def upload_new(self, host):
        if self.impl == TORCH:
            return self.torch.from_numpy(host).to(f"cuda:{self.index}")
        return self.cupy.asarray(host)

    def upload(self, host, dev) -> None:
        if self.impl == TORCH:
            dev.copy_(self.torch.from_numpy(host))
        else:
            dev.set(host)

    def download(self, dev, host) -> None:
        if self.impl == TORCH:
            self.torch.from_numpy(host).copy_(dev)
        else:
            dev.get(out=host)

    def zero(self, dev) -> None:
        if self.impl == TORCH:
            dev.zero_()
        else:
            dev.fill(0)

    def synchronize(self) -> None:
        if self.impl == TORCH:
            self.torch.cuda.synchronize(self.index)
        else:
            self.cupy.cuda.Device(self.index).synchronize()

    # -- holding the caller's stream (the per-call rows) -----------------------------------------

    def _spin_cycles(self, cycles: float) -> None:
        if self.impl == TORCH:
            self.torch.cuda._sleep(int(cycles))
            return
        kernel = getattr(self, "_kernel", None)
        if kernel is None:
            kernel = self._kernel = self.cupy.RawKernel(
                'extern "C" __global__ void spin(long long cycles) {'
                ' long long start = clock64(); while (clock64() - start < cycles) {} }', "spin")
        kernel((1,), (1,), (self.cupy.int64(int(cycles)),))

    def _event(self):
        if self.impl == TORCH:
            event = self.torch.cuda.Event()
            event.record()
            return event
        return self.cupy.cuda.get_current_stream().record()

    def spin(self, seconds: float):
        """Keep the current stream busy for about ``seconds``; returns an event that completes
        when it is done (cycles per second measured once, with the device otherwise idle)."""
        rate = getattr(self, "_rate", None)
        if rate is None:
            self.synchronize()
            started = time.perf_counter()
            self._spin_cycles(10_000_000)
            self.synchronize()
            rate = self._rate = 10_000_000 / max(time.perf_counter() - started, 1e-6)
        self._spin_cycles(rate * seconds)
        return self._event()

    def finished(self, event) -> bool:
        return bool(event.query() if self.impl == TORCH else event.done)


class _DeviceCase:
    """cases.Case (host buffers, the pattern, the check) with a device copy of each
    buffer: the call runs on the device ones, fill and check go through the host ones."""

    def __init__(self, case, device: _Device):
        self.case, self.device = case, device
        hosts = [getattr(case, name) for name in ("buf", "inp", "out") if hasattr(case, name)]
        self.pairs = [(host, device.upload_new(host)) for host in hosts]
        self._by_host = {id(host): dev for host, dev in self.pairs}

    def bind(self, dist) -> Callable[[], Any]:
        return self.case.bind(dist, lambda host: self._by_host[id(host)])

    def fill(self) -> None:
        self.case.fill()
        for host, dev in self.pairs:
            self.device.upload(host, dev)

    def check(self) -> Optional[str]:
        self.device.synchronize()
        for host, dev in self.pairs:
            self.device.download(dev, host)
        return self.case.check()

    def zero(self) -> None:
        for _, dev in self.pairs:
            self.device.zero(dev)


def _init(impl: str, backend: str, device: _Device, timeout_s: float):
    """init_process_group of ``impl`` on ``backend``, the group bound to the rank's GPU for nccl."""
    if impl == TORCH:
        import torch.distributed as tdist

        bound = device.torch.device("cuda", device.index) if backend == "nccl" else None
        tdist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=bound)
        return tdist
    import distlib

    distlib.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                               device_id=device.index if backend == "nccl" else None)
    return distlib


def _cuda_rank_child(conn, impl: str, backend: str, rank: int, world: int, port: int, devices: int,
                     timeout_s: float) -> Dict[str, Any]:
    """One rank: its GPU, init, then serve ("measure", ...) until "stop" (as collectives_ranks.rank_child)."""
    index, env = placement(rank, world, devices, backend)
    child_env(env, rank, world, port)
    device = _Device(impl, index)
    dist = _init(impl, backend, device, timeout_s)
    conn.send(("ready", rank))

    def prepare(op: str, count: int, dtype: str):
        case = _DeviceCase(Case(op, count, dtype, rank, world), device)
        return case, case.bind(dist)

    def per_call(calls: int, in_flight: bool) -> Dict[str, Any]:
        try:
            return per_call_round(dist, device, rank, world, calls, in_flight)
        except Exception as exc:  # noqa: BLE001 - reported in the row
            return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}

    return serve(_PerCallConn(conn, per_call), rank, dist, prepare, sync=device.synchronize)


class _PerCallConn:
    """The rank's pipe as collectives.serve sees it, answering ("per_call", calls, in_flight)
    requests itself (the sweep's protocol stays collectives.py's)."""

    def __init__(self, conn, per_call: Callable[[int, bool], Dict[str, Any]]):
        self.conn, self.per_call = conn, per_call

    def send(self, message) -> None:
        self.conn.send(message)

    def recv(self):
        while True:
            message = self.conn.recv()
            if message[0] != "per_call":
                return message
            self.conn.send(("result", self.per_call(*message[1:])))


def per_call_round(dist, device: _Device, rank: int, world: int, calls: int, in_flight: bool) -> Dict[str, Any]:
    """``calls`` 8-byte all_reduces (MAX): back to back, timed to the device's end, or issued
    behind a stream held longer than they take, timed on the host only (each call returns
    once enqueued: that is what a call costs with that many in flight)."""
    import numpy as np

    x = device.upload_new(np.full(2, rank + 1.0, np.float32))
    for _ in range(20):
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    device.synchronize()
    dist.barrier()
    device.synchronize()
    held = None
    if in_flight:
        end = device.spin(calls * SPIN_PER_CALL_S + 0.05)
        started = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        took = time.perf_counter() - started
        held = not device.finished(end)
        device.synchronize()
    else:
        started = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        device.synchronize()
        took = time.perf_counter() - started
    host = np.zeros(2, np.float32)
    device.download(x, host)
    wrong = None if host.tolist() == [float(world)] * 2 else f"got {host.tolist()}, want {[float(world)] * 2}"
    return {"per_call_s": took / calls, "held": held, "wrong": wrong}


def _probe_child(conn, with_torch: bool) -> Dict[str, Any]:
    """What the GPUs and libraries are, asked in a forked child so the parent never initialises
    CUDA (its later children could not use it)."""
    from distlib.backends import cupy_env

    from distlib import gpu_info

    facts = gpu_info.report(check=False)
    facts["count"] = cupy_env.status().devices
    if with_torch:
        import torch

        facts["torch_cuda"] = torch.version.cuda
        facts["torch_devices"] = torch.cuda.device_count()
        facts["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if facts["torch_devices"] else None
    return facts


# -- the sweep ----------------------------------------------------------------------------------


class CudaCollectivesBench(CollectivesBench):
    """collectives.CollectivesBench with GPU ranks, the target sizes in every sweep, and the
    targets of the GPU run."""

    def __init__(self, args: argparse.Namespace, impls, say: Printer, devices: int):
        super().__init__(args, impls, say)
        self.backend = args.backend or "nccl"
        self.devices = devices
        #: (calls, in flight, row) of the per-call rows, when this run has them (module doc)
        self.per_call_rows: List[Tuple[int, bool, Row]] = []
        self.per_call_absent = "needs all_reduce and 8 B in the sizes"
        if self.backend == "nccl" and "all_reduce" in args.ops and args.min_bytes <= 8 <= args.max_bytes:
            if self.n > devices:  # NCCL's sockets between ranks of one GPU: ~4.5 ms per operation
                self.per_call_absent = (f"not measured: {self.n} ranks share {devices} GPU(s), where each operation "
                                        f"takes milliseconds on the device (NCCL's sockets)")
            else:
                self.per_call_rows = [(BACK_TO_BACK, False, Row("per call", f"{BACK_TO_BACK} back to back", "s",
                                                                False))]
                self.per_call_rows += [(d, True, Row("per call", f"{d:,} in flight", "s", False)) for d in DEPTHS]

    def collectives(self) -> None:
        super().collectives()
        self._per_call()

    def _per_call(self) -> None:
        """The per-call rows, each implementation's group started once, rounds interleaved."""
        groups: Dict[str, Any] = {}
        try:
            for _rnd, impl in interleaved(self.args.rounds if self.per_call_rows else 0, self.impls):
                for calls, in_flight, row in self.per_call_rows:
                    if impl in row.errors:
                        continue
                    if groups.get(impl) is None:
                        try:
                            self.say(f"  starting {self.n} {impl} ranks for the per-call rows ...")
                            groups[impl] = self._start_group(impl)
                        except BenchError as exc:
                            for _, _, failed in self.per_call_rows:
                                failed.fail(impl, str(exc).splitlines()[0])
                            self.failures.append(f"per-call rows, {impl}: {exc}")
                            break
                    self.say(f"  8 B all_reduce, {row.name}, {impl} ...")
                    try:
                        for child in groups[impl].ranks:
                            child.send(("per_call", calls, in_flight))
                        replies = [child.recv(self.args.timeout) for child in groups[impl].ranks]
                    except BenchError as exc:
                        row.fail(impl, str(exc).splitlines()[0])
                        self.failures.append(f"per-call {row.name}, {impl}: {exc}")
                        groups.pop(impl).stop()
                        continue
                    problem = next((r.get("error") or f"WRONG: {r['wrong']}" for r in replies
                                    if r.get("error") or r.get("wrong")), None)
                    if problem:
                        row.fail(impl, problem)
                        self.failures.append(f"per-call {row.name}, {impl}: {problem}")
                        continue
                    per_rank = [r["per_call_s"] for r in replies]
                    row.add(impl, max(per_rank), per_rank_us=[round(t * 1e6, 3) for t in per_rank],
                            held=[r["held"] for r in replies])
        finally:
            for group in groups.values():
                if group is not None:
                    group.stop()

    def op_tables(self) -> List[str]:
        tables = super().op_tables()
        if self.per_call_rows:
            tables.append(self._per_call_table())
        return tables

    def _per_call_table(self) -> str:
        others = [impl for impl in self.impls if impl != DISTLIB]
        headers = ["8 B all_reduce (MAX)", "distlib (us/call)"]
        for impl in others:
            headers += [f"{SHORT[impl]} (us/call)"] + (["ratio"] if impl == self.reference else [])
        headers.append("held to the end")
        table = Table(headers, "l" + "r" * (len(headers) - 2) + "l")
        for _calls, in_flight, row in self.per_call_rows:
            cells = [row.name]
            for impl in [DISTLIB, *others]:
                cells.append(self._value_text(row, impl))
                if impl == self.reference:
                    cells.append(fmt_speedup(row.speedup(DISTLIB, impl)))
            held = [h for details in row.details.values() for d in details for h in (d.get("held") or [])]
            cells.append("-" if not in_flight else "yes" if held and all(held) else "NO: the spin ended first")
            table.add(*cells)
        return table.render()

    def collectives_json(self) -> List[Dict[str, Any]]:
        out = super().collectives_json()
        for calls, in_flight, row in self.per_call_rows:
            entry: Dict[str, Any] = {"op": "all_reduce", "reduce_op": "MAX", "bytes": 8, "count": 2, "dtype": "float32",
                                     "ranks": self.n, "calls": calls, "in_flight": in_flight}
            for impl in self.impls:
                values = row.values.get(impl, [])
                entry[impl] = {
                    "time_us": row.median(impl) * 1e6 if values and math.isfinite(row.median(impl)) else None,
                    "rounds_us": [round(v * 1e6, 3) for v in values],
                    "per_rank_us": [d.get("per_rank_us") for d in row.details.get(impl, [])],
                    "held": [d.get("held") for d in row.details.get(impl, [])],
                    "validated": bool(values) and impl not in row.errors,
                    "error": row.errors.get(impl),
                }
            out.append(entry)
        return out

    def _start_group(self, impl: str) -> RankGroup:
        n, backend, devices, timeout = self.n, self.backend, self.devices, self.args.timeout
        return RankGroup(impl, n, timeout, lambda r, port: Child(
            _cuda_rank_child, impl, backend, r, n, port, devices, timeout, name=f"{impl}-{backend}-cuda-rank-{r}"))

    def _plan(self) -> None:
        super()._plan()
        have = {(p.op, p.nbytes) for p in self.points}
        if "all_reduce" not in self.args.ops:
            return
        for nbytes in TARGET_SIZES:
            size, count = op_size("all_reduce", nbytes, self.itemsize, self.n)
            if self.args.min_bytes <= nbytes <= self.args.max_bytes and ("all_reduce", size) not in have:
                self.points.append(SweepPoint("all_reduce", size, count, Row("all_reduce", f"{size} B", "s", False),
                                              {}))
        self.points.sort(key=lambda p: (self.args.ops.index(p.op), p.nbytes))

    def _add_targets(self) -> None:
        if self.backend != "nccl":
            return
        def find(nbytes: int) -> Optional[Row]:
            if self.args.dtype != BUSBW["applies"]["dtype"] and nbytes == BUSBW["applies"]["bytes"]:
                return None
            for p in self.points:
                if p.op == "all_reduce" and p.nbytes == nbytes:
                    return p.row
            return None

        for spec, what in ((BUSBW, "busbw"), (LATENCY, "latency")):
            if self.n not in spec["applies"]["ranks"]:
                continue
            nbytes = spec["applies"]["bytes"]
            label = f"nccl all_reduce {format_size(nbytes)} {what}, {self.n} rank(s)"
            row = find(nbytes)
            if row is None:
                row = Row("targets", label, "s", False, note=f"not in this run (needs {format_size(nbytes)} "
                                                             f"all_reduce{' of float32' if what == 'busbw' else ''})")
            row.target = spec["target"]
            self.targets.append((label, row))
        rows = {(calls, in_flight): row for calls, in_flight, row in self.per_call_rows}
        if self.n in PER_CALL["applies"]["ranks"]:
            label = f"nccl 8 B all_reduce, {BACK_TO_BACK} back to back, {self.n} rank(s)"
            row = rows.get((BACK_TO_BACK, False)) or Row("targets", label, "s", False, note=self.per_call_absent)
            row.target = PER_CALL["target"]
            self.targets.append((label, row))
        if self.n in DEPTH["applies"]["ranks"]:
            shallow, deep = (rows.get((d, True)) for d in (min(DEPTHS), max(DEPTHS)))
            label = f"nccl 8 B all_reduce, {max(DEPTHS):,} in flight vs {min(DEPTHS)}, {self.n} rank(s)"
            if shallow is None or deep is None:
                row = Row("targets", label, "s", False, note=self.per_call_absent)
            else:
                row = _DepthRow("targets", label, "s", False, values=deep.values, details=deep.details,
                                errors=deep.errors, shallow=shallow,
                                note=f"ratio: distlib's time per call at {min(DEPTHS)} / at {max(DEPTHS):,}")
            row.target = DEPTH["target"]
            self.targets.append((label, row))

    def _value_text(self, row: Row, impl: str) -> str:
        """busbw (algbw at 1 rank, where busbw is 0 by definition) for the bandwidth target, else a time."""
        if impl in row.errors:
            return "WRONG" if row.errors[impl].startswith("WRONG") else "FAILED"
        value = row.median(impl)
        if value != value:  # NaN: not measured
            return "-"
        nbytes = BUSBW["applies"]["bytes"]
        if row.section == "all_reduce" and row.name == f"{nbytes} B":
            algbw = algbw_gbs(nbytes, value)
            if self.n == 1:
                return f"algbw {algbw:.1f} GB/s"
            return f"{algbw * busbw_factor('all_reduce', self.n):.1f} GB/s"
        return fmt_seconds(value)


@dataclass
class _DepthRow(Row):
    """A target row judged against distlib itself: its values are the deep row's (so the
    table shows the time per call with the most in flight), its ratio is distlib's time at the
    shallow depth over that."""

    shallow: Optional[Row] = None

    def speedup(self, impl: str = "distlib", reference: str = "torch") -> float:
        ours, base = self.median(impl), self.shallow.median(impl) if self.shallow else float("nan")
        return float("nan") if math.isnan(ours) or math.isnan(base) or ours <= 0 else base / ours


# -- the command --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """`distlib bench collectives --device cuda` (collectives_cli.main's options, cuda defaults)."""
    if args.backend == "mpi":
        raise ToolError("--backend mpi measures host arrays: leave out --device cuda "
                        "(cupy arrays on the mpi backend go through host memory, as on gloo)", 2)
    problem = check_args(args)
    if problem:
        raise ToolError(problem, 2)
    say = Printer(args.quiet)
    cpu.preload_distlib()
    impls, torch_version, why_not = implementations(args.no_torch)
    facts = run_child(_probe_child, TORCH in impls, timeout=args.timeout, name="cuda-probe")
    if not facts.get("count"):
        raise ToolError(f"--device cuda needs a CUDA device: {facts.get('problem') or 'none found'}")
    if TORCH in impls and not facts.get("torch_devices"):
        impls, why_not = [DISTLIB], f"torch {torch_version} sees no CUDA device (CUDA {facts.get('torch_cuda')})"
    raise_fd_limit()
    backend = args.backend or "nccl"
    bench = CudaCollectivesBench(args, impls, say, facts["count"])
    started = time.monotonic()
    say(f"distlib bench collectives --device cuda: {args.nproc} rank(s) on {min(args.nproc, facts['count'])} GPU(s), "
        f"{backend}, {', '.join(args.ops)}; {args.min_bytes}..{args.max_bytes} B x{args.step_factor}; "
        f"{args.rounds} round(s); " + (f"torch {torch_version}" if TORCH in impls else f"torch not measured ({why_not})"))
    try:
        bench.collectives()
    except BenchError as exc:
        bench.failures.append(str(exc))
    wall = time.monotonic() - started
    env = environment({"device": "cuda", "backend": backend, "gpus": facts["devices"],
                              "cupy": facts.get("cupy"), "nccl": facts.get("nccl"),
                              "torch_nccl": facts.get("torch_nccl"), "driver": facts.get("driver")})
    return finish(args, bench, impls, header(args, facts, impls, torch_version, why_not, env, wall), env, wall)


def header(args: argparse.Namespace, facts: Dict[str, Any], impls, torch_version: Optional[str], why_not: str,
           env: Dict[str, Any], wall: float) -> List[str]:
    """What the run compared, on what, and how it timed."""
    backend = args.backend or "nccl"
    ours = f"distlib {env['distlib']} {backend} on cupy {facts.get('cupy')}" + (
        f" (NCCL {facts.get('nccl')})" if backend == "nccl" else " (staged through host memory)")
    theirs = (f" vs torch {torch_version} {backend} on CUDA tensors"
              + (f" (NCCL {facts.get('torch_nccl')})" if backend == "nccl" else "")
              if TORCH in impls else f" (torch not measured: {why_not})")
    shared = args.nproc > facts["count"]
    placement = (f"{args.nproc} ranks on {facts['count']} GPU(s)"
                 + (", sharing them: each rank its own NCCL_HOSTID (NCCL's socket transport over loopback), both "
                    "implementations alike" if shared and backend == "nccl" else ", sharing them" if shared else
                    ", one each"))
    return [
        f"distlib bench collectives --device cuda: {ours}{theirs}",
        f"{facts['devices'][0] if facts['devices'] else '?'}; CUDA driver {facts.get('driver')}, runtime "
        f"{facts.get('cuda_runtime')}; {placement}",
        f"{args.iters} iters after {args.warmup} warmup; the host synchronises the device after the warmup, the "
        f"barrier and the last op; time = max over ranks of the mean per op; median of {args.rounds} interleaved "
        f"round(s); {wall:.0f} s",
    ]



