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

Targets (targets.json, section ``collectives_cuda``): nccl all_reduce float32 busbw at 256 MiB
at least 0.95x torch's nccl, and the 8-byte all_reduce at most 1.2x torch's time, at 1 and 2
ranks; gloo with cupy arrays is reported against torch's gloo without a target.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from distlib.net import raise_fd_limit
from ..command import ToolError
from ..sizes import format_size
from . import collectives as cpu
from .cases import Case
from .children import BenchError, Child, run_child
from .collectives_measure import CollectivesBench
from .collectives_ops import MIB, SweepPoint, algbw_gbs, busbw_factor, op_size
from .collectives_ranks import RankGroup, child_env, serve
from .collectives_report import finish
from .results import DISTLIB, TORCH, Row, implementations, load_targets
from .tables import Printer, environment, fmt_seconds


TARGETS = load_targets("collectives_cuda")
BUSBW = TARGETS["nccl_busbw"]
LATENCY = TARGETS["nccl_latency"]
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

    return serve(conn, rank, dist, prepare, sync=device.synchronize)


def _probe_child(conn, with_torch: bool) -> Dict[str, Any]:
    """What the GPUs and libraries are, asked in a forked child so the parent never initialises
    CUDA (its later children could not use it)."""
    from distlib.backends import cupy_env

    from .. import gpu_info

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



