"""The ranks of ``distlib bench collectives`` that run under mpirun: distlib's ``mpi`` backend
and raw mpi4py, on the same buffers.

    mpirun -n N python -m distlib_bench.mpi_ranks --control SOCKET --impls distlib,mpi4py

The bench starts this itself (bench/mpi_group.py); it is not a command of its own. Each rank
imports mpi4py first (MPI initialises as a raw mpi4py program's does, at
MPI_THREAD_MULTIPLE), joins distlib's ``init_process_group("mpi")`` when ``distlib`` is among
the implementations, and takes a duplicate of MPI_COMM_WORLD for the raw calls — the floor a
user of mpi4py would write:

    all_reduce      comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
    broadcast       comm.Bcast(buf, root=0)
    reduce          comm.Reduce(MPI.IN_PLACE or buf, buf or None, MPI.SUM, root=0)
    all_gather_into_tensor   comm.Allgather(inp, out)
    reduce_scatter_tensor    comm.Reduce_scatter_block(inp, out, MPI.SUM)
    all_to_all_single        comm.Alltoall(inp, out)

Then it connects to the bench's control socket and serves ("measure", impl, op, count, dtype,
iters, warmup, validate) until ("stop",): one op at one size, by one implementation, filled,
checked and timed as every rank of the bench is (bench/cases.py). The buffers of a size are
kept while the bench alternates implementations on it, so both time the same memory. Between
commands a rank blocks in a socket read, not in MPI, so an idle MPI job takes no CPU from the
groups the bench measures meanwhile.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

from .cases import Case, measure
from .channel import connect

DISTLIB, MPI4PY = "distlib", "mpi4py"


def bind_mpi4py(case: Case, comm, MPI) -> Callable[[], Any]:  # noqa: N803 - the module's own name
    """The raw mpi4py call for ``case`` on ``comm`` (see the module docstring)."""
    op = case.op
    if op == "all_reduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, case.buf, MPI.SUM)
    if op == "broadcast":
        return lambda: comm.Bcast(case.buf, root=0)
    if op == "reduce":
        if comm.Get_rank() == 0:
            return lambda: comm.Reduce(MPI.IN_PLACE, case.buf, MPI.SUM, root=0)
        return lambda: comm.Reduce(case.buf, None, MPI.SUM, root=0)
    if op == "all_gather_into_tensor":
        return lambda: comm.Allgather(case.inp, case.out)
    if op == "reduce_scatter_tensor":
        return lambda: comm.Reduce_scatter_block(case.inp, case.out, MPI.SUM)
    if op == "all_to_all_single":
        return lambda: comm.Alltoall(case.inp, case.out)
    raise ValueError(f"unknown op {op!r}")


def serve(channel, impls: List[str], comm, MPI, dist) -> int:  # noqa: N803
    """Answer the bench's commands until it says stop (or goes away); the number measured."""
    rank, size = comm.Get_rank(), comm.Get_size()
    key: Optional[Tuple[str, int, str]] = None
    case: Optional[Case] = None
    measured = 0
    while True:
        try:
            msg = channel.recv(None)
        except EOFError:
            break
        if msg[0] == "stop":
            break
        _, impl, op, count, dtype, iters, warmup, validate = msg
        reply: Dict[str, Any] = {"rank": rank}
        try:
            if impl not in impls:
                raise ValueError(f"{impl} is not measured by this job (it measures {', '.join(impls)})")
            if case is None or key != (op, count, dtype):
                key, case = None, None  # free the last size's buffers first
                case = Case(op, count, dtype, rank, size)
                key = (op, count, dtype)
            if impl == DISTLIB:
                call, barrier = case.bind(dist, lambda a: a), dist.barrier
            else:
                call, barrier = bind_mpi4py(case, comm, MPI), comm.Barrier
            reply.update(measure(case, call, barrier, iters, warmup, validate))
        except Exception as exc:  # noqa: BLE001 - e.g. a dtype this MPI lacks: reported per row
            reply["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        measured += 1
        channel.send(("result", reply))
    return measured


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distlib_bench.mpi_ranks", description=__doc__.splitlines()[0])
    p.add_argument("--control", required=True, help="the bench's control socket")
    p.add_argument("--impls", required=True, help="comma-separated: distlib, mpi4py")
    p.add_argument("--timeout", type=float, default=300.0, help="distlib's group timeout (seconds)")
    args = p.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    from mpi4py import MPI  # first: MPI initialises as raw mpi4py's does (MPI_THREAD_MULTIPLE)

    comm = MPI.COMM_WORLD.Dup()
    dist: Optional[ModuleType] = None
    if DISTLIB in impls:
        import distlib

        distlib.init_process_group("mpi", timeout=timedelta(seconds=args.timeout))
        dist = distlib
    channel = connect(args.control, f"the bench (from rank {comm.Get_rank()})")
    library = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    channel.send(("ready", comm.Get_rank(), socket.gethostname(), os.getpid(), library))
    try:
        serve(channel, impls, comm, MPI, dist)
    finally:
        channel.close()
        if dist is not None:
            dist.destroy_process_group()
        comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
