"""What each rank runs under mpirun: ``python -m tests.mpi.runner --suite S --out DIR``.

One launch runs a whole suite (a plan of cases), so the suite's hundreds of cases cost one
MPI start-up per world size, not one each. Every case is a function ``fn(rank, world_size,
*args)`` (the gloo tests' tests/collectives/cases.py, and mpi_cases.py); its outcome — the
value, or the traceback — is appended to ``DIR/rank<R>.pkl`` as soon as it is known, so a job
that dies half-way still reports every case before the failure. pytest reads the files
(launch.py) and checks each case.
"""

from __future__ import annotations

import argparse
import os
import pickle
import traceback
import warnings
from datetime import timedelta
from typing import Callable, List, Tuple

Plan = List[Tuple[str, Callable, tuple]]

ALL_REDUCE_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"]
REDUCE_DTYPES = ["bool", "int8", "int32", "uint64", "float16", "float32", "float64", "complex64"]
SIZES = [0, 1, 7, 1003, 70_001]


def matrix_plan(ws: int) -> Plan:
    from tests.collectives import cases

    from . import mpi_cases as m

    plan: Plan = [("world_info", m.world_info, ())]
    for op in ALL_REDUCE_OPS:
        plan.append((f"all_reduce/{op}", cases.all_reduce_matrix, (op, cases.ALL_DTYPES, SIZES)))
    for op in ALL_REDUCE_OPS:
        for root in sorted({0, ws - 1}):
            plan.append((f"reduce/{op}/root{root}", cases.reduce_matrix, (op, REDUCE_DTYPES, [0, 1, 1003, 70_001],
                                                                          root)))
        plan.append((f"reduce_scatter/{op}", cases.reduce_scatter_matrix, (op, REDUCE_DTYPES, [0, 1, 5, 20_003])))
    plan.append(("broadcast", cases.broadcast_cases, (["bool", "int16", "float16", "float32", "complex128"],
                                                      [0, 1, 1003, 300_007])))
    for dtype, n in [("int32", 0), ("float64", 1), ("uint8", 1003), ("float16", 70_001), ("bool", 9)]:
        plan.append((f"gather_family/{dtype}/{n}", cases.gather_family, (dtype, n)))
    for dtype, n in [("int64", 1), ("float32", 4097), ("complex64", 3)]:
        plan.append((f"all_to_all/{dtype}/{n}", cases.all_to_all_cases, (dtype, n)))
    plan += [
        ("all_to_all_sizes", m.all_to_all_different_sizes, ()),
        ("barriers", cases.barrier_cases, ()),
        ("p2p", cases.p2p_cases, ()),
        ("p2p_mpi", m.p2p_checks, ()),
        ("isend_does_not_wait_for_the_group", m.isend_then_collective, ()),
        ("async_ordering", cases.async_ordering, ()),
        ("async_two_groups", m.async_two_groups, ()),
        ("async_every_collective", m.async_every_collective, ()),
        ("wide_dtypes", m.wide_dtypes, ()),
        ("objects", cases.object_cases, ()),
        ("bad_input", cases.bad_input_errors, ()),
        ("bad_input_mpi", m.bad_input_mpi, ()),
        ("staged", m.staged, ()),
        ("subgroups", m.subgroups, ()),
        ("monitored_barrier_late_rank", m.monitored_barrier_late_rank, ()),
        ("reinit", m.destroy_and_init_again, ()),
    ]
    return plan


def failure_plan(ws: int) -> Plan:
    from . import mpi_cases as m

    return [("pids", m.pid, ()), ("killed_mid_all_reduce", m.killed_mid_all_reduce, (1,))]


def stall_plan(ws: int) -> Plan:
    from . import mpi_cases as m

    return [("pids", m.pid, ()), ("stalled_rank", m.stalled_rank, (ws - 1,))]


def mismatch_plan(ws: int) -> Plan:
    from . import mpi_cases as m

    return [("pids", m.pid, ()), ("other_collective", m.other_collective, (ws - 1,))]


def aborted_plan(ws: int) -> Plan:
    from . import mpi_cases as m

    return [("pids", m.pid, ()), ("mismatch_stays_aborted", m.mismatch_stays_aborted, ()),
            ("waits_on_the_failed_ranks", m.waits_on_the_failed_ranks, ())]


def exit_pending_plan(ws: int) -> Plan:
    from . import mpi_cases as m

    return [("pids", m.pid, ()), ("left_in_flight", m.async_left_in_flight, ())]


SUITES = {"matrix": matrix_plan, "killed": failure_plan, "stall": stall_plan, "exit_pending": exit_pending_plan,
          "mismatch": mismatch_plan, "aborted": aborted_plan}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=60.0, help="the group timeout (s)")
    parser.add_argument("--last-rank-timeout", type=float, help="the last rank's group timeout (s), if another")
    args = parser.parse_args()
    import distlib as dist

    # the rank is known before init from Open MPI's variables (the tests run Open MPI's mpirun)
    last = os.environ.get("OMPI_COMM_WORLD_RANK") == str(int(os.environ.get("OMPI_COMM_WORLD_SIZE", "0")) - 1)
    timeout = args.last_rank_timeout if last and args.last_rank_timeout is not None else args.timeout
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # rank and world_size that MPI contradicts: ignored, with torch's warning
        dist.init_process_group("mpi", rank=99, world_size=99, timeout=timedelta(seconds=timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(args.out, f"rank{rank}.pkl"), "wb") as out:
        pickle.dump(("init_warnings", ("ok", [str(w.message) for w in caught])), out)
        for case_id, fn, fn_args in SUITES[args.suite](ws):
            try:
                outcome = ("ok", fn(rank, ws, *fn_args))
            except BaseException as exc:  # noqa: BLE001 - recorded for pytest
                outcome = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            pickle.dump((case_id, outcome), out)
            out.flush()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
