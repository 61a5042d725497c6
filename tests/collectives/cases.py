"""Functions that run on every rank of a WorkerPool (module-level so they pickle by reference).

Every rank builds every rank's input deterministically, so each rank checks its own result
against a numpy reference computed locally; results also come back as hashes so the parent
can check that every rank holds bit-identical data.
"""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta

import numpy as np

import distlib as dist
from distlib import ReduceOp

ALL_DTYPES = ["bool", "int8", "uint8", "int16", "int32", "uint32", "int64", "uint64", "float16", "float32",
              "float64", "complex64", "complex128"]
SIZES = [0, 1, 7, 1003, 70_001, 300_007]


def valid(op_name: str, dtype: str) -> bool:
    kind = np.dtype(dtype).kind
    if op_name in ("BAND", "BOR", "BXOR"):
        return kind in "iub"
    if op_name in ("AVG", "PREMUL_SUM"):
        return kind in "fc"
    if op_name in ("MIN", "MAX"):
        return kind != "c"
    return True


def make_input(rank: int, dtype: str, n: int, op_name: str = "SUM") -> np.ndarray:
    rng = np.random.default_rng(1000 + 31 * rank + n)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if dt.kind in "iu":
        low = 0 if dt.kind == "u" else -4
        return rng.integers(low, 5, n).astype(dt)
    if op_name == "PRODUCT":
        values = rng.uniform(0.5, 1.5, n)
    else:
        values = rng.standard_normal(n)
    if dt.kind == "c":
        values = values + 1j * (rng.uniform(0.5, 1.5, n) if op_name == "PRODUCT" else rng.standard_normal(n))
    return values.astype(dt)


def reference(op_name: str, inputs, factor: float = 2.0) -> np.ndarray:
    stack = np.stack(inputs)
    dt = stack.dtype
    if dt == np.bool_:
        fn = {"SUM": np.logical_or, "MAX": np.logical_or, "BOR": np.logical_or, "PRODUCT": np.logical_and,
              "MIN": np.logical_and, "BAND": np.logical_and, "BXOR": np.logical_xor}[op_name]
        return fn.reduce(stack, axis=0)
    if op_name == "SUM":
        return np.sum(stack, axis=0, dtype=dt)
    if op_name == "AVG":
        return (np.sum(stack, axis=0, dtype=dt) / len(inputs)).astype(dt)
    if op_name == "PREMUL_SUM":
        return np.sum(stack * dt.type(factor), axis=0, dtype=dt)
    if op_name == "PRODUCT":
        return np.prod(stack, axis=0, dtype=dt)
    if op_name == "MIN":
        return np.min(stack, axis=0)
    if op_name == "MAX":
        return np.max(stack, axis=0)
    return {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op_name].reduce(stack, axis=0)


def close(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype.kind in "fc":
        rtol = {2: 2e-2, 4: 1e-4, 8: 1e-10, 16: 1e-4}.get(a.dtype.itemsize, 1e-4)
        if a.dtype.kind == "c":
            rtol = 1e-4 if a.dtype.itemsize == 8 else 1e-10
        return bool(np.allclose(a, b, rtol=rtol, atol=rtol * 10, equal_nan=True))
    return bool(np.array_equal(a, b))


def digest(array: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(array).tobytes()).hexdigest()


def as_op(op_name: str):
    if op_name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(2.0)
    return getattr(ReduceOp, op_name)


# -- cases ----------------------------------------------------------------------------------------


def all_reduce_matrix(rank, ws, op_name, dtypes, sizes):
    """Run all_reduce for every (dtype, size); return [(dtype, size, ok, digest)]."""
    out = []
    for dtype in dtypes:
        if not valid(op_name, dtype):
            continue
        for n in sizes:
            inputs = [make_input(r, dtype, n, op_name) for r in range(ws)]
            array = inputs[rank].copy()
            dist.all_reduce(array, op=as_op(op_name))
            out.append((dtype, n, close(array, reference(op_name, inputs)), digest(array)))
    return out


def all_reduce_matrix_traced(rank, ws, op_name, dtypes, sizes):
    """all_reduce_matrix, and the way each all_reduce went: [(dtype, size, ok, digest, path)],
    path being the mesh algorithm's name (algorithms/reduce.py's ALL_REDUCE), "small" (the
    small shared-memory channel), "segment" (the large shared segment) or "" (none: one rank).
    Each way is traced by wrapping the function the router calls for it."""
    from distlib.backends.gloo.algorithms import reduce as reduce_algos
    from distlib.backends.gloo.algorithms import shm_small
    from distlib.backends.gloo.algorithms.shm_allreduce import ShmAllReduce

    taken = []

    def traced(path, fn):
        def run(*args, **kwargs):
            taken.append(path)
            return fn(*args, **kwargs)
        return run

    table, small, segment = dict(reduce_algos.ALL_REDUCE), shm_small.all_reduce, ShmAllReduce.run
    reduce_algos.ALL_REDUCE.update({name: traced(name, fn) for name, fn in table.items()})
    shm_small.all_reduce = traced("small", small)
    ShmAllReduce.run = traced("segment", segment)
    out = []
    try:
        for dtype in dtypes:
            if not valid(op_name, dtype):
                continue
            for n in sizes:
                inputs = [make_input(r, dtype, n, op_name) for r in range(ws)]
                array = inputs[rank].copy()
                before = len(taken)
                dist.all_reduce(array, op=as_op(op_name))
                path = "+".join(taken[before:])
                out.append((dtype, n, close(array, reference(op_name, inputs)), digest(array), path))
    finally:
        reduce_algos.ALL_REDUCE.update(table)
        shm_small.all_reduce = small
        ShmAllReduce.run = segment
    return out


def reduce_matrix(rank, ws, op_name, dtypes, sizes, root):
    out = []
    for dtype in dtypes:
        if not valid(op_name, dtype):
            continue
        for n in sizes:
            inputs = [make_input(r, dtype, n, op_name) for r in range(ws)]
            array = inputs[rank].copy()
            dist.reduce(array, dst=root, op=as_op(op_name))
            if rank == root:
                ok = close(array, reference(op_name, inputs))
            else:
                ok = np.array_equal(array, inputs[rank])  # non-roots' input is left alone
            out.append((dtype, n, bool(ok)))
    return out


def reduce_scatter_matrix(rank, ws, op_name, dtypes, sizes):
    out = []
    for dtype in dtypes:
        if not valid(op_name, dtype):
            continue
        for n in sizes:
            inputs = [make_input(r, dtype, n * ws, op_name) for r in range(ws)]
            full = reference(op_name, inputs)
            expect = full[rank * n:(rank + 1) * n]
            output = np.empty(n, np.dtype(dtype))
            source = inputs[rank].copy()
            dist.reduce_scatter_tensor(output, source, op=as_op(op_name))
            ok_tensor = close(output, expect) and np.array_equal(source, inputs[rank])
            output2 = np.empty(n, np.dtype(dtype))
            dist.reduce_scatter(output2, [inputs[rank][k * n:(k + 1) * n].copy() for k in range(ws)],
                                op=as_op(op_name))
            out.append((dtype, n, bool(ok_tensor), close(output2, expect)))
    return out


def first_wrong(got, expected, where: str = ""):
    """True if ``got`` equals ``expected`` (shape and elements), else what is wrong: the first
    wrong element, its value and the expected one, and how many are wrong (``where`` first)."""
    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape:
        return f"{where}shape {got.shape}, expected {expected.shape}"
    bad = np.flatnonzero(got.reshape(-1) != expected.reshape(-1))
    if bad.size == 0:
        return True
    i = int(bad[0])
    return (f"{where}element {i} is {got.reshape(-1)[i].item()!r}, expected {expected.reshape(-1)[i].item()!r} "
            f"({bad.size} of {got.size} wrong)")


def first_of(checks):
    """The first result of ``checks`` that is not True (first_wrong's text), or True."""
    return next((c for c in checks if c is not True), True)


def wrong(results: dict) -> dict:
    """The entries of a case's results that are not True: what went wrong, by name."""
    return {name: value for name, value in results.items() if value is not True}


def broadcast_cases(rank, ws, dtypes, sizes):
    out = []
    for root in sorted({0, ws - 1}):
        for dtype in dtypes:
            for n in sizes:
                data = make_input(root, dtype, n).reshape(-1)
                array = data.copy() if rank == root else np.zeros(n, np.dtype(dtype))
                dist.broadcast(array, src=root)
                out.append((root, dtype, n, first_wrong(array, data, f"rank {rank}: ")))
    return out


def gather_family(rank, ws, dtype, n):
    """all_gather, all_gather_into_tensor, gather (to every root), scatter (from every root)."""
    mine = make_input(rank, dtype, n)
    everyone = [make_input(r, dtype, n) for r in range(ws)]
    results = {}
    outputs = [np.empty(n, np.dtype(dtype)) for _ in range(ws)]
    dist.all_gather(outputs, mine)
    results["all_gather"] = first_of(first_wrong(o, e, f"from rank {k}: ")
                                     for k, (o, e) in enumerate(zip(outputs, everyone, strict=True)))
    flat = np.empty(n * ws, np.dtype(dtype))
    dist.all_gather_into_tensor(flat, mine)
    results["all_gather_into_tensor"] = first_wrong(flat, np.concatenate(everyone))
    gather_ok, scatter_ok = [], []
    for root in range(ws):
        gathered = [np.empty(n, np.dtype(dtype)) for _ in range(ws)] if rank == root else None
        dist.gather(mine, gathered, dst=root)
        if rank == root:
            gather_ok += [first_wrong(o, e, f"root {root}, from rank {k}: ")
                          for k, (o, e) in enumerate(zip(gathered, everyone, strict=True))]
        pieces = [make_input(100 + k, dtype, n) for k in range(ws)]
        received = np.empty(n, np.dtype(dtype))
        dist.scatter(received, pieces if rank == root else None, src=root)
        scatter_ok.append(first_wrong(received, pieces[rank], f"root {root}: "))
    results["gather"] = first_of(gather_ok)
    results["scatter"] = first_of(scatter_ok)
    return results


def all_to_all_cases(rank, ws, dtype, n):
    results = {}
    inputs = [np.full(n, 100 * rank + k, np.dtype(dtype)) for k in range(ws)]
    outputs = [np.empty(n, np.dtype(dtype)) for _ in range(ws)]
    dist.all_to_all(outputs, inputs)
    results["all_to_all"] = first_of(first_wrong(outputs[k], np.full(n, 100 * k + rank, np.dtype(dtype)),
                                                 f"from rank {k}: ") for k in range(ws))
    # equal splits of dim 0, rows of 3 elements
    rows = 2 * ws
    src = np.arange(rows * 3, dtype=np.dtype(dtype)).reshape(rows, 3) + 1000 * rank
    dst = np.empty_like(src)
    dist.all_to_all_single(dst, src)
    expect = np.concatenate([(np.arange(rows * 3).reshape(rows, 3) + 1000 * k)[2 * rank:2 * rank + 2]
                             for k in range(ws)]).astype(np.dtype(dtype))
    results["all_to_all_single"] = first_wrong(dst, expect)
    # uneven splits: rank r sends (k + r) % 3 rows to rank k
    send_splits = [(k + rank) % 3 for k in range(ws)]
    recv_splits = [(rank + k) % 3 for k in range(ws)]
    src = np.concatenate([np.full((send_splits[k], 2), 10 * rank + k) for k in range(ws)]).astype(np.dtype(dtype)) \
        if sum(send_splits) else np.empty((0, 2), np.dtype(dtype))
    dst = np.empty((sum(recv_splits), 2), np.dtype(dtype))
    dist.all_to_all_single(dst, src, output_split_sizes=recv_splits, input_split_sizes=send_splits)
    expect = np.concatenate([np.full((recv_splits[k], 2), 10 * k + rank) for k in range(ws)]).astype(np.dtype(dtype)) \
        if sum(recv_splits) else np.empty((0, 2), np.dtype(dtype))
    results["all_to_all_single_uneven"] = first_wrong(dst, expect)
    return results


BARRIER_KINDS = ("barrier", "barrier_async", "monitored_barrier", "monitored_barrier_all")


def barrier_cases(rank, ws, delta=0.05):
    """Each kind of barrier, rank r arriving r x ``delta`` seconds after rank 0: per kind, when
    this rank arrived and when it left (time.time(): one clock for the ranks of one host)."""
    out = {}
    for kind in BARRIER_KINDS:
        dist.barrier()  # start together (a barrier that did not hold would be seen below anyway)
        time.sleep(rank * delta)
        arrived = time.time()
        if kind == "barrier":
            dist.barrier()
        elif kind == "barrier_async":
            dist.barrier(async_op=True).wait()
        else:
            dist.monitored_barrier(timeout=timedelta(seconds=10), wait_all_ranks=kind.endswith("_all"))
        out[kind] = (arrived, time.time())
    return out


def left_before_the_last_arrived(per_rank) -> dict:
    """From barrier_cases' results: per kind, the ranks that left before the last rank arrived,
    and how many seconds before (empty: every barrier held every rank)."""
    early = {}
    for kind in BARRIER_KINDS:
        last = max(times[kind][0] for times in per_rank)
        ranks = {rank: round(last - times[kind][1], 4) for rank, times in enumerate(per_rank)
                 if times[kind][1] < last}
        if ranks:
            early[kind] = ranks
    return early


def p2p_cases(rank, ws):
    """A ring of send/recv, an any-source recv at rank 0, isend/irecv in both orders, tags."""
    if ws == 1:
        return {"skipped": True}
    right, left = (rank + 1) % ws, (rank - 1) % ws
    results = {}
    # ring: even ranks send first, odd ranks receive first (blocking calls)
    buf = np.empty(5, np.int64)
    if rank % 2 == 0:
        dist.send(np.full(5, rank, np.int64), dst=right)
        dist.recv(buf, src=left)
    else:
        dist.recv(buf, src=left)
        dist.send(np.full(5, rank, np.int64), dst=right)
    results["ring"] = bool(np.all(buf == left))
    # isend/irecv both directions at once, large (no deadlock whatever the order)
    big = np.full(1 << 20, rank, np.float32)
    got = np.empty(1 << 20, np.float32)
    if rank % 2:
        reqs = [dist.isend(big, right), dist.irecv(got, left)]
    else:
        reqs = [dist.irecv(got, left), dist.isend(big, right)]
    for req in reqs:
        req.wait()
    results["isend_irecv"] = bool(np.all(got == left)) and all(r.is_completed() and r.is_success() for r in reqs)
    # tags keep messages apart: send tag 7 then tag 3; receive tag 3 first
    if rank == 0:
        a, b = np.empty(1, np.int32), np.empty(1, np.int32)
        wb = dist.irecv(b, src=1, tag=3)
        wa = dist.irecv(a, src=1, tag=7)
        wb.wait()
        wa.wait()
        results["tags"] = (int(a[0]), int(b[0])) == (7, 3)
    elif rank == 1:
        dist.send(np.array([7], np.int32), dst=0, tag=7)
        dist.send(np.array([3], np.int32), dst=0, tag=3)
    # any source: every other rank sends its rank to 0
    if rank == 0:
        senders = set()
        for _ in range(ws - 1):
            box = np.empty(1, np.int64)
            src = dist.recv(box, src=None, tag=11)
            senders.add((src, int(box[0])))
        results["any_source"] = senders == {(r, r) for r in range(1, ws)}
    else:
        dist.send(np.array([rank], np.int64), dst=0, tag=11)
    # batch_isend_irecv ring exchange
    send_buf = np.full(3, rank, np.float64)
    recv_buf = np.empty(3, np.float64)
    ops = [dist.P2POp(dist.isend, send_buf, right), dist.P2POp(dist.irecv, recv_buf, left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    results["batch"] = bool(np.all(recv_buf == left))
    dist.barrier()
    return results


def async_ordering(rank, ws):
    """Async operations on one group run in issue order; Work and Future behave."""
    a = np.ones(1000, np.float64)
    works = [dist.all_reduce(a, async_op=True) for _ in range(5)]
    fut = works[-1].get_future()
    results = {"value": None}
    fut_value = fut.wait()
    for w in works:
        w.wait()
    results["value"] = float(a[0])  # ws ** 5
    results["completed"] = all(w.is_completed() and w.is_success() and w.exception() is None for w in works)
    results["future_value_is_array"] = fut_value[0] is a
    chained = works[0].get_future().then(lambda f: "chained")
    results["then"] = chained.wait()
    # a sync op after pending async ones waits for them (ordering)
    b = np.ones(10, np.int64)
    w1 = dist.all_reduce(b, async_op=True)
    dist.all_reduce(b)
    w1.wait()
    results["sync_after_async"] = int(b[0])  # ws ** 2
    # async broadcast then sync all_reduce
    c = np.full(4, rank, np.float32)
    w2 = dist.broadcast(c, src=0, async_op=True)
    dist.all_reduce(c)
    w2.wait()
    results["broadcast_then_reduce"] = float(c[0])  # 0 * ws
    return results


def object_cases(rank, ws):
    results = {}
    objs = [{"rank": rank, "list": list(range(rank))}, f"s{rank}"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    results["broadcast_object_list"] = objs == [{"rank": 0, "list": []}, "s0"]
    gathered = [None] * ws
    dist.all_gather_object(gathered, ("obj", rank, "x" * rank))
    results["all_gather_object"] = gathered == [("obj", r, "x" * r) for r in range(ws)]
    target = [None] * ws if rank == ws - 1 else None
    dist.gather_object({"r": rank}, target, dst=ws - 1)
    if rank == ws - 1:
        results["gather_object"] = target == [{"r": r} for r in range(ws)]
    out = [None]
    dist.scatter_object_list(out, [f"item{k}" * (k + 1) for k in range(ws)] if rank == 0 else None, src=0)
    results["scatter_object_list"] = out[0] == f"item{rank}" * (rank + 1)
    return results


def bad_input_errors(rank, ws):
    """Each bad input raises before anything is sent; the group stays usable."""
    errors = {}

    def expect(name, exc_type, fn):
        try:
            fn()
        except exc_type as exc:
            errors[name] = str(exc)
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"WRONG TYPE {type(exc).__name__}: {exc}"
        else:
            errors[name] = "NO ERROR"

    noncontig = np.zeros((4, 4), np.float32)[:, 1]
    expect("non_contiguous", ValueError, lambda: dist.all_reduce(noncontig))
    expect("object_dtype", TypeError, lambda: dist.all_reduce(np.array(["a"], dtype=object)))
    expect("not_array", TypeError, lambda: dist.all_reduce([1, 2, 3]))
    expect("bitwise_on_float", TypeError, lambda: dist.all_reduce(np.ones(3), op=ReduceOp.BAND))
    expect("avg_on_int", TypeError, lambda: dist.all_reduce(np.ones(3, np.int32), op=ReduceOp.AVG))
    expect("min_on_complex", TypeError, lambda: dist.all_reduce(np.ones(3, np.complex64), op=ReduceOp.MIN))
    expect("list_length", ValueError, lambda: dist.all_gather([np.zeros(3)] * (ws + 1), np.zeros(3)))
    expect("list_dtype", TypeError, lambda: dist.all_gather([np.zeros(3, np.int32)] * ws, np.zeros(3)))
    expect("rank_out_of_range", ValueError, lambda: dist.broadcast(np.zeros(3), src=ws + 5))
    expect("output_size", ValueError, lambda: dist.all_gather_into_tensor(np.zeros(ws * 3 + 1), np.zeros(3)))
    expect("read_only", ValueError, lambda: dist.all_reduce(np.frombuffer(b"\0" * 8, np.float32)))
    expect("send_to_self", ValueError, lambda: dist.send(np.zeros(1), dst=rank))
    expect("splits", ValueError, lambda: dist.all_to_all_single(np.zeros(ws * 2), np.zeros(ws * 2),
                                                                 input_split_sizes=[1] * (ws + 1)))
    # still usable
    a = np.ones(3)
    dist.all_reduce(a)
    errors["still_works"] = float(a[0]) == ws
    return errors


def on_a_fresh_subgroup(ws, body):
    """``body(group)`` on a new group of every rank, expected to fail: (its error text or
    "no error", seconds, the default group's all_reduce of ones afterwards)."""
    group = dist.new_group(list(range(ws)))
    start = time.monotonic()
    try:
        body(group)
        outcome = "no error"
    except dist.DistBackendError as exc:
        outcome = str(exc)
    elapsed = time.monotonic() - start
    # the broken subgroup is destroyed; the default group keeps working
    dist.destroy_process_group(group)
    check = np.ones(1)
    dist.all_reduce(check)
    return outcome, elapsed, float(check[0])


def mismatched_collectives(rank, ws, kind):
    """On a fresh subgroup: ranks disagree; every rank must raise DistBackendError saying why."""

    def body(group):
        if kind == "shape":
            dist.all_reduce(np.ones(10 + rank, np.float32), group=group)
        elif kind == "dtype":
            dist.all_reduce(np.ones(10, np.float32 if rank == 0 else np.float64), group=group)
        elif kind == "collective":
            if rank == 0:
                dist.all_reduce(np.ones(10, np.float32), group=group)
            else:
                dist.broadcast(np.ones(10, np.float32), src=0, group=group)
        elif kind == "large_shape":
            dist.all_reduce(np.ones(400_000 + rank, np.float32), group=group)

    return on_a_fresh_subgroup(ws, body)


def subgroup_cases(rank, ws, members):
    group = dist.new_group(members)
    results = {"in_group": rank in members}
    if rank in members:
        a = np.full(3, rank, np.int64)
        dist.all_reduce(a, group=group)
        results["sum"] = int(a[0])
        results["group_rank"] = dist.get_rank(group)
        results["group_size"] = dist.get_world_size(group)
        results["ranks"] = dist.get_process_group_ranks(group)
        results["global_of_0"] = dist.get_global_rank(group, 0)
        results["group_of_me"] = dist.get_group_rank(group, rank)
        b = np.full(2, rank, np.float32)
        dist.broadcast(b, src=members[-1], group=group)
        results["broadcast"] = float(b[0])
        dist.destroy_process_group(group)
    else:
        import warnings

        results["is_non_member"] = group is dist.GroupMember.NON_GROUP_MEMBER
        results["rank"] = dist.get_rank(group)
        results["size"] = dist.get_world_size(group)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results["collective_returns"] = dist.all_reduce(np.ones(3), group=group)
        results["warned"] = any("does not belong to the given group" in str(w.message) for w in caught)
    dist.barrier()
    return results


def world_info(rank, ws):
    from distlib.distributed import get_default_group

    meshes = get_default_group().backends["cpu"].meshes
    return {
        "rank": dist.get_rank(), "size": dist.get_world_size(), "backend": dist.get_backend(),
        "initialized": dist.is_initialized(), "world_is_default": dist.GroupMember.WORLD is get_default_group(),
        # after every test that ran on this pool before: the progress threads must still be up
        "progress_threads_alive": all(m.progress.alive() for m in meshes),
    }


def pipelining_settings(rank, ws):
    """The piece size and scratch budget this rank's ring runs with."""
    from distlib.backends.gloo.algorithms import context

    return context.PIPE_BYTES, context.SCRATCH_LIMIT


def crowded_transport(rank, ws, n):
    """SO_RCVBUF of each of this rank's connections, then an all_reduce of ``n`` float32
    through them (checked against numpy), then a second one whose frames may arrive early."""
    import socket as socketlib

    from distlib.distributed import get_default_group

    mesh = get_default_group().backends["cpu"].meshes[0]
    buffers = [c.sock.getsockopt(socketlib.SOL_SOCKET, socketlib.SO_RCVBUF) for c in mesh.conns if c is not None]
    oks = []
    for _ in range(2):
        inputs = [make_input(r, "float32", n, "SUM") for r in range(ws)]
        array = inputs[rank].copy()
        dist.all_reduce(array)
        oks.append(bool(close(array, reference("SUM", inputs))))
    return buffers, oks


#: What each rank tries after the group failed (issue 37): each must raise on every rank.
LATER_OPERATIONS = ["all_reduce", "large all_reduce", "broadcast", "barrier", "all_gather", "reduce_scatter"]


def _later(name, rank, ws, group):
    if name == "all_reduce":
        dist.all_reduce(np.ones(4, np.float32), group=group)
    elif name == "large all_reduce":
        dist.all_reduce(np.ones(300_000, np.float32), group=group)
    elif name == "broadcast":
        dist.broadcast(np.ones(4, np.float32), src=0, group=group)
    elif name == "barrier":
        dist.barrier(group=group)
    elif name == "all_gather":
        dist.all_gather([np.empty(3, np.int32) for _ in range(ws)], np.full(3, rank, np.int32), group=group)
    elif name == "reduce_scatter":
        dist.reduce_scatter(np.empty(2, np.float64), [np.ones(2) for _ in range(ws)], group=group)


def stays_aborted(rank, ws, how):
    """A new group of every rank fails (``how``: "mismatch", an all_reduce of float32[4] on rank
    0 against float32[8] on the others; "timeout", rank 0 waits past the group timeout for rank
    1, which joins only once it has learnt of the abort; "abort", rank 0 aborts the group), then
    every rank tries each of LATER_OPERATIONS on it. Returns (the first error this rank saw, or
    "no error"; [(operation, its error text or "no error")]); the group is destroyed after, and
    the default group still works."""
    group = dist.new_group(list(range(ws)), timeout=timedelta(seconds=3))
    first = "no error"
    try:
        if how == "mismatch":
            dist.all_reduce(np.ones(4 if rank == 0 else 8, np.float32), group=group)
        elif how == "timeout":
            if rank == 1:  # joins once rank 0's timeout has aborted the group (an observable condition)
                health = group.backends["cpu"].meshes[0].health
                deadline = time.monotonic() + 30
                while health.error is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            dist.all_reduce(np.ones(4, np.float32), group=group)
        elif how == "abort":
            if rank == 0:  # torch's _abort_process_group: the group is gone here, the others must learn it
                dist.distributed._abort_process_group(group)
                check = np.ones(1)
                dist.all_reduce(check)
                return "aborted by this rank", [], float(check[0])
            dist.all_reduce(np.ones(4, np.float32), group=group)
    except dist.DistBackendError as exc:
        first = str(exc)
    later = []
    for name in LATER_OPERATIONS:
        try:
            _later(name, rank, ws, group)
            later.append((name, "no error"))
        except dist.DistBackendError as exc:
            later.append((name, str(exc)))
    dist.destroy_process_group(group)
    check = np.ones(1)
    dist.all_reduce(check)
    return first, later, float(check[0])
