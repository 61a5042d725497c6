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
import os
import time
from typing import Dict, List, Optional, Tuple

from distlib.net import raise_fd_limit
from distlib import command
from distlib.command import ToolError
from distlib_deploy.sizes import parse_size
from . import mpi_group
from .children import BenchError
from .collectives_measure import CollectivesBench
from .collectives_ops import (ALIASES, BACKENDS, DEFAULT_OPS, DISTLIB_GLOO, DTYPES, INIT_ABSOLUTE_WS, INIT_RELATIVE_WS,
                              MIB, MPI4PY, OPS, SHORT)
from .collectives_report import finish
from .results import DISTLIB, TORCH, implementations
from .tables import Printer, environment

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


def check_args(args: argparse.Namespace) -> Optional[str]:
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


def preload_distlib() -> None:
    """Import what a rank's init uses, once in the parent, so that no forked rank pays for
    imports inside the timed init (torch is imported here too, for the same reason)."""
    import numpy  # noqa: F401

    from distlib import collectives, distributed  # noqa: F401
    from distlib.backends.gloo import backend as gloo  # noqa: F401


def _implementations(args: argparse.Namespace) -> Tuple[List[str], Dict[str, str], Dict[str, str]]:
    """(what this run measures, in table order; their versions; why each one left out is). gloo:
    distlib, torch, mpi4py; mpi: distlib, mpi4py, distlib's gloo, torch."""
    mpi = args.backend == "mpi"
    no_torch = args.no_torch or (mpi and args.no_gloo)
    found, torch_version, torch_why = implementations(no_torch)
    why_not: Dict[str, str] = {}
    versions: Dict[str, str] = {}
    if TORCH in found:
        assert torch_version is not None, "implementations() gives torch's version whenever it measures torch"
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
    problem = check_args(args)
    if problem:
        raise ToolError(problem, 2)
    say = Printer(args.quiet)

    preload_distlib()
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

    env = environment({"transport": args.transport, "distlib_shm_all_reduce": bench.shm_used})
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
