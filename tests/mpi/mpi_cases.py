"""Cases that only the mpi backend has (run by runner.py under mpirun; module-level functions
``fn(rank, world_size, ...)``). The backend-neutral cases are tests/collectives/cases.py."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from datetime import timedelta

import numpy as np

import distlib as dist


def world_info(rank, ws):
    from mpi4py import MPI

    from distlib.backends.mpi import runtime as mpi_runtime
    from distlib.distributed import get_default_group

    group = dist.new_group(list(range(ws)))
    info = {
        "rank": dist.get_rank(), "size": dist.get_world_size(), "backend": dist.get_backend(),
        "subgroup_backend": dist.get_backend(group), "initialized": dist.is_initialized(),
        "available": dist.is_mpi_available() and dist.is_backend_available("mpi"),
        "world_is_default": dist.GroupMember.WORLD is get_default_group(),
        "mpi_rank": MPI.COMM_WORLD.Get_rank(), "mpi_size": MPI.COMM_WORLD.Get_size(),
        "thread_level": mpi_runtime.thread_level_name(),
    }
    dist.destroy_process_group(group)
    return info


def all_to_all_different_sizes(rank, ws):
    """all_to_all with a different size to each peer (rank r sends r + k + 1 items to k)."""
    inputs = [np.full(rank + k + 1, 100 * rank + k, np.int32) for k in range(ws)]
    outputs = [np.empty(k + rank + 1, np.int32) for k in range(ws)]
    dist.all_to_all(outputs, inputs)
    return all(np.array_equal(outputs[k], np.full(k + rank + 1, 100 * k + rank, np.int32)) for k in range(ws))


def p2p_checks(rank, ws):
    """recv with src=None returns the sender's global rank in a subgroup too; a message of
    another size is an error naming both sizes; the group works afterwards."""
    results = {}
    if ws < 2:
        return {"skipped": True}
    group = dist.new_group([0, ws - 1])  # group rank 1 is global rank ws - 1
    if rank == ws - 1:
        dist.send(np.arange(4, dtype=np.float64), group=group, group_dst=0, tag=5)
        dist.send(np.arange(3, dtype=np.float64), dst=0, group=group, tag=6)
        dist.send(np.arange(9, dtype=np.float64), dst=0, group=group, tag=7)
    elif rank == 0:
        box = np.empty(4, np.float64)
        results["sender"] = dist.recv(box, src=None, group=group, tag=5)
        results["data"] = box.tolist()
        for tag, name in ((6, "shorter"), (7, "longer")):
            try:
                dist.recv(np.empty(4, np.float64), src=ws - 1, group=group, tag=tag)
                results[name] = "no error"
            except dist.DistBackendError as exc:
                results[name] = str(exc)
    if rank in (0, ws - 1):
        check = np.ones(2)
        dist.all_reduce(check, group=group)
        results["group_still_works"] = float(check[0]) == 2.0
        dist.destroy_process_group(group)
    dist.barrier()
    return results


def isend_then_collective(rank, ws):
    """Rank 0 isends 8 MiB to rank 1 and then joins an all_reduce; rank 1 joins the all_reduce
    first and receives afterwards. MPI_Isend progresses on its own: no deadlock (a send that
    waited in the group's queue would block the all_reduce behind it)."""
    if ws < 2:
        return True
    big = np.arange(1 << 21, dtype=np.float32)
    a = np.ones(4)
    if rank == 0:
        work = dist.isend(big, dst=1, tag=3)
        dist.all_reduce(a)
        work.wait()
        ok = work.is_completed()
    elif rank == 1:
        dist.all_reduce(a)
        box = np.empty_like(big)
        ok = dist.recv(box, src=0, tag=3) == 0 and np.array_equal(box, big)
    else:
        dist.all_reduce(a)
        ok = True
    return bool(ok) and float(a[0]) == ws


def async_two_groups(rank, ws):
    """Async operations on two groups at once; each group keeps its own order; results right."""
    other = dist.new_group(list(range(ws)))
    a = np.ones(1000, np.float64)
    b = np.full(1000, 2.0)
    works = []
    for _ in range(3):
        works.append(dist.all_reduce(a, async_op=True))
        works.append(dist.all_reduce(b, op=dist.ReduceOp.MAX, group=other, async_op=True))
    works.append(dist.broadcast(b, src=0, group=other, async_op=True))
    for w in works:
        w.wait()
    done = all(w.is_completed() and w.is_success() for w in works)
    dist.destroy_process_group(other)
    return done, float(a[0]), float(b[0])


def bad_input_mpi(rank, ws):
    from mpi4py import MPI

    errors = {}

    def expect(name, exc_type, fn):
        try:
            fn()
            errors[name] = "NO ERROR"
        except exc_type as exc:
            errors[name] = str(exc)
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"WRONG TYPE {type(exc).__name__}: {exc}"

    tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    if tag_ub < 2**32 - 1 and ws > 1:
        expect("tag_above_ub", ValueError, lambda: dist.irecv(np.zeros(1), src=(rank + 1) % ws, tag=tag_ub + 1))
    expect("gloo_subgroup", ValueError, lambda: dist.new_group(list(range(ws)), backend="gloo"))
    a = np.ones(3)
    dist.all_reduce(a)
    errors["still_works"] = float(a[0]) == ws
    return errors


def subgroups(rank, ws):
    """Subgroups of several shapes (with ranks outside), created by every rank or, with
    use_local_synchronization, by the members only; collectives inside each checked."""
    from tests.collectives import cases

    results = {}
    shapes = {"first": [0], "last": [ws - 1], "ends": sorted({0, ws - 1}), "all": list(range(ws)),
              "evens": list(range(0, ws, 2))}
    for name, members in shapes.items():
        results[name] = cases.subgroup_cases(rank, ws, members)
    # members only: the others never call new_group
    members = list(range(1, ws)) or [0]
    if rank in members:
        group = dist.new_group(members, use_local_synchronization=True)
        a = np.full(2, rank, np.int64)
        dist.all_reduce(a, group=group)
        out = [np.empty(1, np.int64) for _ in members]
        dist.all_gather(out, np.array([rank * 10], np.int64), group=group)
        results["local_sync"] = (int(a[0]), [int(o[0]) for o in out], dist.get_rank(group))
        dist.destroy_process_group(group)
    dist.barrier()
    return results


def monitored_barrier_late_rank(rank, ws):
    """The last rank comes 2.5 s late to a 1 s monitored_barrier: rank 0 names it; the late
    rank is told the barrier failed; the group works afterwards."""
    if ws < 2:
        dist.monitored_barrier(timeout=timedelta(seconds=1))
        return {"skipped": True}
    late = ws - 1
    if rank == late:
        time.sleep(2.5)
    started = time.monotonic()
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=True)
        outcome = "no error"
    except dist.DistBackendError as exc:
        outcome = str(exc)
    elapsed = time.monotonic() - started
    dist.barrier()
    a = np.ones(1)
    dist.all_reduce(a)
    return {"outcome": outcome, "elapsed": elapsed, "after": float(a[0])}


def destroy_and_init_again(rank, ws):
    """destroy, then init again with the rank and size MPI has (no warning), and work."""
    dist.destroy_process_group()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group("mpi", rank=rank, world_size=ws)
    a = np.full(2, rank, np.int64)
    dist.all_reduce(a)
    outcome = (dist.get_rank(), dist.get_world_size(), int(a[0]), [str(w.message) for w in caught])
    dist.destroy_process_group()
    return outcome


def pid(rank, ws):
    return os.getpid()


def killed_mid_all_reduce(rank, ws, victim):
    """all_reduce in a loop; the victim SIGKILLs itself half-way through one."""
    a = np.ones(1 << 18, np.float32)
    for step in range(10_000):
        if rank == victim and step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(a)
        a[:] = 1
    return "survived"


def stalled_rank(rank, ws, victim):
    """The victim stays in its own code; the others wait in an all_reduce until the watchdog
    ends the job."""
    if rank == victim:
        time.sleep(600)
    dist.all_reduce(np.ones(4, np.float32))
    return "finished"


def async_left_in_flight(rank, ws):
    """Rank 0 starts an all_reduce nobody else joins and never waits for it, then exits."""
    if rank == 0:
        from distlib.backends.mpi.watchdog import WATCHDOG

        dist.all_reduce(np.ones(4), async_op=True)
        deadline = time.monotonic() + 20
        while not WATCHDOG.in_flight() and time.monotonic() < deadline:  # until the executor is in MPI
            time.sleep(0.01)
    return "returned"


def other_collective(rank, ws, odd_one):
    """``odd_one`` broadcasts while the others all_reduce: nobody can finish. Its group timeout
    is 20 times the others' (tests/mpi/test_failures.py: ``--last-rank-timeout``), so their
    watchdogs are the ones to expire and report what it runs."""
    a = np.ones(4, np.float32)
    if rank == odd_one:
        dist.broadcast(a, src=0)
    else:
        dist.all_reduce(a)
    return "finished"


def async_every_collective(rank, ws):
    """Every collective with async_op=True, all issued before any is waited for; each result
    checked after its wait (issue order is kept, so later ones see earlier results)."""
    results = {}
    a = np.full(5, rank + 1.0)
    b = np.full(3, float(rank))
    red = np.full(4, rank + 1, np.int64)
    gathered = [np.empty(2, np.int32) for _ in range(ws)]
    flat = np.empty(2 * ws, np.int32)
    mine = np.full(2, rank, np.int32)
    rs_out = np.empty(2, np.float32)
    rs_in = np.arange(2 * ws, dtype=np.float32)
    rsl_out = np.empty(2, np.float32)
    a2a_out = np.empty(ws, np.int64)
    a2a_in = np.arange(ws, dtype=np.int64) + 10 * rank
    sc_out = np.empty(2, np.int16)
    ga_list = [np.empty(2, np.int32) for _ in range(ws)] if rank == 0 else None
    works = {
        "all_reduce": dist.all_reduce(a, op=dist.ReduceOp.AVG, async_op=True),
        "broadcast": dist.broadcast(b, src=ws - 1, async_op=True),
        "reduce": dist.reduce(red, dst=0, op=dist.ReduceOp.BXOR, async_op=True),
        "all_gather": dist.all_gather(gathered, mine, async_op=True),
        "all_gather_into_tensor": dist.all_gather_into_tensor(flat, mine, async_op=True),
        "gather": dist.gather(mine, ga_list, dst=0, async_op=True),
        "scatter": dist.scatter(sc_out, [np.full(2, k, np.int16) for k in range(ws)] if rank == 0 else None, src=0,
                                async_op=True),
        "reduce_scatter_tensor": dist.reduce_scatter_tensor(rs_out, rs_in, async_op=True),
        "reduce_scatter": dist.reduce_scatter(rsl_out, [rs_in[2 * k:2 * k + 2].copy() for k in range(ws)],
                                              op=dist.ReduceOp.MAX, async_op=True),
        "all_to_all_single": dist.all_to_all_single(a2a_out, a2a_in, async_op=True),
        "barrier": dist.barrier(async_op=True),
    }
    for work in works.values():
        work.wait()
    results["all_completed"] = all(w.is_completed() and w.is_success() for w in works.values())
    results["all_reduce"] = bool(np.allclose(a, (ws + 1) / 2))
    results["broadcast"] = bool(np.all(b == ws - 1))
    expect_xor = 0
    for r in range(ws):
        expect_xor ^= r + 1
    results["reduce"] = bool(np.all(red == expect_xor)) if rank == 0 else bool(np.all(red == rank + 1))
    results["all_gather"] = all(np.all(g == k) for k, g in enumerate(gathered))
    results["all_gather_into_tensor"] = bool(np.array_equal(flat, np.repeat(np.arange(ws, dtype=np.int32), 2)))
    results["gather"] = all(np.all(g == k) for k, g in enumerate(ga_list)) if rank == 0 else True
    results["scatter"] = bool(np.all(sc_out == rank))
    results["reduce_scatter_tensor"] = bool(np.array_equal(rs_out, ws * rs_in[2 * rank:2 * rank + 2]))
    results["reduce_scatter"] = bool(np.array_equal(rsl_out, rs_in[2 * rank:2 * rank + 2]))
    results["all_to_all_single"] = bool(np.array_equal(a2a_out, np.arange(ws) * 10 + rank))
    return results


def wide_dtypes(rank, ws):
    """long double and its complex: SUM, PRODUCT (and MAX for the real one) against numpy."""
    from tests.collectives import cases

    out = {}
    for dtype in (np.longdouble, np.clongdouble):
        for op in ("SUM", "PRODUCT", "MAX"):
            if op == "MAX" and np.dtype(dtype).kind == "c":
                continue
            inputs = [(np.arange(1, 6) * (r + 1) / 7).astype(dtype) for r in range(ws)]
            array = inputs[rank].copy()
            dist.all_reduce(array, op=getattr(dist.ReduceOp, op))
            out[f"{np.dtype(dtype).name}/{op}"] = cases.close(array, cases.reference(op, inputs))
    return out


def staged(rank, ws):
    """cupy's path on the mpi backend: every collective through cuda_staging.HostStaged, with
    numpy copies standing in for cupy's device<->host copies (the cupy copies need a GPU)."""
    from tests.gpu.staging_cases import every_collective

    return every_collective(rank, ws)


#: Whether this rank saw the mismatch (mismatch_stays_aborted), for the case after it.
_SAW_THE_MISMATCH = []


def mismatch_stays_aborted(rank, ws):
    """all_reduce of float32[4] on rank 0 against float32[8] on the others: MPI reports it on
    the ranks that receive more than they posted (MPI_ERR_TRUNCATE), and is silent on the
    others. A rank that saw the error then tries every one of cases.LATER_OPERATIONS on the
    group: each must be refused at once, naming that error. Returns (the first error or "no
    error", [(operation, its error or "no error")])."""
    from tests.collectives import cases

    first = "no error"
    try:
        dist.all_reduce(np.ones(4 if rank == 0 else 8, np.float32))
    except dist.DistBackendError as exc:
        first = str(exc)
        _SAW_THE_MISMATCH.append(first)
    later = []
    if first != "no error":
        for name in cases.LATER_OPERATIONS:
            try:
                cases._later(name, rank, ws, None)
                later.append((name, "no error"))
            except dist.DistBackendError as exc:
                later.append((name, str(exc)))
    return first, later


def waits_on_the_failed_ranks(rank, ws):
    """The ranks where MPI said nothing go on with the group and wait in an all_reduce for the
    ranks that failed, which wait in their own code: past the group timeout the waiting ranks'
    watchdogs end the job, naming the failed ranks and their failure (what each rank answers
    when asked, mpi/watchdog.py)."""
    if _SAW_THE_MISMATCH:
        threading.Event().wait(120)  # in this rank's own code until the job is ended
        return "not ended"
    dist.all_reduce(np.ones(4, np.float32))
    return "finished"
