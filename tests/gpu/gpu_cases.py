"""Rank functions for test_nccl_gpu.py (fresh processes through harness.spawn; module-level so
they pickle). Each returns what the test asserts on; a list of problems is empty when all is
right. Several ranks share one GPU: see one_gpu_env."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import numpy as np

from tests.collectives.cases import close, make_input, reference

DTYPES = ["bool", "int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
          "complex64", "complex128"]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"]


def one_gpu_env(rank: int) -> dict:
    """What lets several ranks of one communicator share a GPU, in tests only: each rank its own
    NCCL_HOSTID (NCCL then takes them for separate hosts and uses its socket transport, over
    loopback). NCCL_MULTI_RANK_GPU_ENABLE=1 does it too from NCCL 2.30 on, experimentally and for
    about two ranks per GPU; the host ids work with every NCCL and any number of ranks."""
    return {"NCCL_HOSTID": f"distlib-test-rank{rank}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def _init(rank, ws, path, backend="nccl", timeout_s=60, device_id=0):
    import faulthandler

    faulthandler.enable()  # a native crash prints every thread's Python stack
    if ws > 1:
        os.environ.update(one_gpu_env(rank))
    import cupy

    import distlib as dist

    cupy.cuda.Device(0).use()
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=timeout_s), device_id=device_id)
    return dist, cupy


def _op(dist, name):
    return dist._make_nccl_premul_sum(2.0) if name == "PREMUL_SUM" else getattr(dist.ReduceOp, name)


def _nccl_accepts(dtype, name):
    kind = np.dtype(dtype).kind
    if name in ("AVG", "PREMUL_SUM") and kind not in "fc":
        return False
    if name in ("MIN", "MAX", "PRODUCT") and kind == "c":
        return False
    return True


class _Problems(list):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def case(self, label, fn):
        try:
            problem = fn()
        except Exception as exc:  # noqa: BLE001 - every case reports
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            self.append(f"rank {self.rank}, {label}: {problem}")


def _same(got, want):
    return None if got.dtype == want.dtype and close(got, want) else f"got {got}, want {want}"


# -- every collective x op x dtype ----------------------------------------------------------------


def every_collective(rank, ws, path):
    dist, cp = _init(rank, ws, path)
    problems = _Problems(rank)
    g = cp.asarray

    def run(call, async_op):
        work = call(async_op)
        if async_op:
            assert work is not None and work.wait() is True
        else:
            assert work is None

    for dtype in DTYPES:
        for name in OPS:
            if not _nccl_accepts(dtype, name):
                continue
            op = _op(dist, name)
            for n in (1, 1000):
                inputs = [make_input(r, dtype, n * ws, name) for r in range(ws)]
                want = reference(name, inputs)
                for async_op in (False, True):
                    tag = f"{name} {dtype} n={n} async={async_op}"

                    def all_reduce():
                        x = g(inputs[rank])
                        run(lambda a: dist.all_reduce(x, op=op, async_op=a), async_op)
                        return _same(x.get(), want)

                    problems.case(f"all_reduce {tag}", all_reduce)
                    for root in sorted({0, ws - 1}):
                        def reduce():
                            x = g(inputs[rank])
                            run(lambda a: dist.reduce(x, dst=root, op=op, async_op=a), async_op)
                            return _same(x.get(), want if rank == root else inputs[rank])

                        problems.case(f"reduce to {root} {tag}", reduce)

                    def reduce_scatter_tensor():
                        out = cp.zeros(n, dtype)
                        run(lambda a: dist.reduce_scatter_tensor(out, g(inputs[rank]), op=op, async_op=a), async_op)
                        return _same(out.get(), want[rank * n:(rank + 1) * n])

                    problems.case(f"reduce_scatter_tensor {tag}", reduce_scatter_tensor)

                    def reduce_scatter():
                        out = cp.zeros(n, dtype)
                        parts = [g(inputs[rank][k * n:(k + 1) * n]) for k in range(ws)]
                        run(lambda a: dist.reduce_scatter(out, parts, op=op, async_op=a), async_op)
                        return _same(out.get(), want[rank * n:(rank + 1) * n])

                    problems.case(f"reduce_scatter {tag}", reduce_scatter)

        inputs = [make_input(r, dtype, 5) for r in range(ws)]
        mine = inputs[rank]
        for async_op in (False, True):
            tag = f"{dtype} async={async_op}"
            for root in range(ws):
                def broadcast():
                    x = g(mine)
                    run(lambda a: dist.broadcast(x, src=root, async_op=a), async_op)
                    return _same(x.get(), inputs[root])

                problems.case(f"broadcast from {root} {tag}", broadcast)

                def gather():
                    outs = [cp.zeros(5, dtype) for _ in range(ws)] if rank == root else None
                    run(lambda a: dist.gather(g(mine), outs, dst=root, async_op=a), async_op)
                    if rank == root:
                        return next((f"slot {k}: {_same(o.get(), inputs[k])}" for k, o in enumerate(outs)
                                     if _same(o.get(), inputs[k])), None)

                problems.case(f"gather to {root} {tag}", gather)

                def scatter():
                    out = cp.zeros(5, dtype)
                    pieces = [g(inputs[k]) for k in range(ws)] if rank == root else None
                    run(lambda a: dist.scatter(out, pieces, src=root, async_op=a), async_op)
                    return _same(out.get(), inputs[rank])

                problems.case(f"scatter from {root} {tag}", scatter)

            def all_gather():
                outs = [cp.zeros(5, dtype) for _ in range(ws)]
                run(lambda a: dist.all_gather(outs, g(mine), async_op=a), async_op)
                return next((f"slot {k}" for k, o in enumerate(outs) if _same(o.get(), inputs[k])), None)

            problems.case(f"all_gather {tag}", all_gather)

            def all_gather_into_tensor():
                out = cp.zeros(5 * ws, dtype)
                run(lambda a: dist.all_gather_into_tensor(out, g(mine), async_op=a), async_op)
                return _same(out.get(), np.concatenate(inputs))

            problems.case(f"all_gather_into_tensor {tag}", all_gather_into_tensor)

            def all_to_all():
                sent = [make_input(10 * rank + k, dtype, k + 1) for k in range(ws)]
                outs = [cp.zeros(rank + 1, dtype) for _ in range(ws)]
                run(lambda a: dist.all_to_all(outs, [g(s) for s in sent], async_op=a), async_op)
                return next((f"from {k}" for k, o in enumerate(outs)
                             if _same(o.get(), make_input(10 * k + rank, dtype, rank + 1))), None)

            problems.case(f"all_to_all {tag}", all_to_all)

            def all_to_all_single():
                splits = [(rank + k) % 3 for k in range(ws)]  # rows this rank sends to k
                rows_in = [(k + rank) % 3 for k in range(ws)]  # rows k sends here
                data = make_input(rank, dtype, sum(splits) * 2).reshape(-1, 2)
                out = cp.zeros((sum(rows_in), 2), dtype)
                run(lambda a: dist.all_to_all_single(out, g(data), rows_in, splits, async_op=a), async_op)
                want_rows = []
                for k in range(ws):
                    theirs = [(k + j) % 3 for j in range(ws)]
                    start = sum(theirs[:rank])
                    want_rows.append(make_input(k, dtype, sum(theirs) * 2).reshape(-1, 2)[start:start + theirs[rank]])
                return _same(out.get(), np.concatenate(want_rows))

            problems.case(f"all_to_all_single {tag}", all_to_all_single)

        if ws > 1:
            def batch_ring():
                got = cp.zeros(5, dtype)
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, g(mine), (rank + 1) % ws),
                                                dist.P2POp(dist.irecv, got, (rank - 1) % ws)])
                assert len(works) == 1  # one NCCL group, one Work, as torch
                for w in works:
                    w.wait()
                return _same(got.get(), inputs[(rank - 1) % ws])

            problems.case(f"batch_isend_irecv ring {dtype}", batch_ring)

            def pair():
                if rank == 0:
                    dist.send(g(mine), dst=1)
                elif rank == 1:
                    box = cp.zeros(5, dtype)
                    source = dist.recv(box, src=0)
                    return _same(box.get(), inputs[0]) or (None if source == 0 else f"source {source}")

            problems.case(f"send/recv {dtype}", pair)

            def async_pair():
                if rank == 0:
                    dist.isend(g(mine), dst=1).wait()
                elif rank == 1:
                    box = cp.zeros(5, dtype)
                    dist.irecv(box, src=0).wait()
                    return _same(box.get(), inputs[0])

            problems.case(f"isend/irecv {dtype}", async_pair)

    def barrier():
        dist.barrier()
        work = dist.barrier(async_op=True)
        work.wait()
        return None if work.is_completed() else "barrier's work not complete after wait()"

    problems.case("barrier", barrier)

    def objects():
        payload = [{"rank": rank, "data": list(range(rank + 1))}, "x" * (rank + 3)]
        out = list(payload) if rank == 0 else [None, None]
        dist.broadcast_object_list(out, src=0)
        gathered = [None] * ws
        dist.all_gather_object(gathered, ("me", rank))
        into = [None] * ws if rank == 0 else None
        dist.gather_object(rank * 10, into, dst=0)
        one = [None]
        dist.scatter_object_list(one, [f"for {k}" for k in range(ws)] if rank == 0 else None, src=0)
        if out != [{"rank": 0, "data": [0]}, "xxx"]:
            return f"broadcast_object_list {out}"
        if gathered != [("me", k) for k in range(ws)]:
            return f"all_gather_object {gathered}"
        if rank == 0 and into != [k * 10 for k in range(ws)]:
            return f"gather_object {into}"
        return None if one == [f"for {rank}"] else f"scatter_object_list {one}"

    problems.case("object collectives", objects)
    dist.destroy_process_group()
    return list(problems)


def refusals(rank, ws, path):
    """What the nccl backend refuses is refused before anything is enqueued, on every rank alike,
    and the group goes on working."""
    dist, cp = _init(rank, ws, path)
    return refusals_on(dist, cp, ws)


def refusals_on(dist, cp, ws):
    """refusals' steps on an initialised nccl group (a GPU's, or the fake's in the CPU suite):
    [(error type, text, nothing enqueued)], and the all_reduce after them."""
    backend = dist.distributed.get_default_group().backends["cuda"]
    seen = []

    def refused(fn):
        before = (backend.seq, backend.p2p_seq)
        try:
            fn()
        except (TypeError, ValueError) as exc:
            seen.append((type(exc).__name__, str(exc), (backend.seq, backend.p2p_seq) == before))
            return
        seen.append(("no error", "", False))

    x = cp.ones(4, np.int32)
    refused(lambda: dist.all_reduce(x, op=dist.ReduceOp.BAND))
    refused(lambda: dist.all_reduce(cp.ones(4, np.int16)))
    refused(lambda: dist.broadcast(cp.ones(4, np.uint16), src=0))
    refused(lambda: dist.all_reduce(cp.ones(4, np.complex64), op=dist.ReduceOp.PRODUCT))
    refused(lambda: dist.all_reduce(cp.ones((4, 4), np.float32)[:, 0]))
    refused(lambda: dist.all_gather_into_tensor(np.zeros(4 * ws, np.float32), cp.ones(4, np.float32)))
    if ws > 1:
        refused(lambda: dist.recv(cp.zeros(4, np.float32)))  # src=None
    refused(lambda: dist.all_reduce(cp.ones(4, np.int32), op=dist.ReduceOp.AVG))
    y = cp.ones(4, np.float32)
    dist.all_reduce(y)
    still = float(y.get()[0])
    dist.destroy_process_group()
    return seen, still


def refusal_problems(seen, still, ws):
    """What is wrong with refusals' answer: each refusal's text as users read it, nothing
    enqueued by any, and a working group after them ([] when all is right)."""
    texts = [text for _, text, _ in seen]
    want = [
        "Cannot use ReduceOp.BAND with NCCL: NCCL has no bitwise reductions",
        "Input tensor data type is not supported for NCCL process group: int16",
        "Input tensor data type is not supported for NCCL process group: uint16",
        "Cannot use ReduceOp.PRODUCT on complex64 with NCCL",
        "tensor is not contiguous (shape (4,), strides (16,)): pass cupy.ascontiguousarray(tensor)",
        "one operation's arrays must all be numpy arrays or all cupy arrays, but it has a cpu array "
        "(numpy.ndarray) beside a cuda one",
    ] + (["the nccl backend cannot receive from any source (src=None): NCCL has no wildcard receive"]
         if ws > 1 else []) + ["ReduceOp.AVG needs a floating-point array"]
    problems = [f"refusal {i}: {kind} {text!r} was enqueued" for i, (kind, text, untouched) in enumerate(seen)
                if not untouched]
    if len(texts) != len(want):
        problems.append(f"{len(texts)} refusals, {len(want)} expected: {texts}")
    for i, (text, start) in enumerate(zip(texts, want, strict=False)):
        if not text.startswith(start):
            problems.append(f"refusal {i}: {text!r} does not start with {start!r}")
    if still != ws:
        problems.append(f"the all_reduce after the refusals gave {still}, not {ws}")
    return problems


def async_ordering(rank, ws, path):
    """Work on the caller's stream before a collective is seen by it; work after it sees the
    result. The caller's stream is a non-blocking one, kept busy by a train of large copies."""
    dist, cp = _init(rank, ws, path)
    big_a, big_b = cp.zeros(64 << 20, np.uint8), cp.zeros(64 << 20, np.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    results = []
    for async_op in (False, True):
        with stream:  # everything on the caller's stream, x's allocation too (a non-blocking
            x = cp.zeros(1 << 16, np.float32)  # stream does not wait for the null stream's memset)
            for _ in range(200):  # ~tens of ms of copies ahead of the value the collective must see
                cp.cuda.runtime.memcpyAsync(big_b.data.ptr, big_a.data.ptr, big_a.nbytes,
                                            cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
            x.set(np.full(1 << 16, rank + 1, np.float32), stream=stream)
            work = dist.all_reduce(x, async_op=async_op)
            if work is not None:
                work.wait()
            seen = x.get(stream=stream)  # enqueued after the collective, on the caller's stream
        results.append(float(seen.min()) == float(seen.max()) == ws * (ws + 1) / 2)
    dist.destroy_process_group()
    return results


def init_destroy_init(rank, ws, path1, path2):
    """init -> collective -> destroy, twice, in one process; destroy stops every nccl thread."""
    out = []
    for path, device_id in ((path1, 0), (path2, None)):
        dist, cp = _init(rank, ws, path, device_id=device_id)
        x = cp.asarray(np.full(3, rank + 1.0, np.float32))
        dist.all_reduce(x)
        out.append(float(x.get()[0]))
        dist.destroy_process_group()
        time.sleep(0.2)
        alive = [t.name for t in threading.enumerate() if t.name.startswith("distlib-nccl") and t.is_alive()]
        out.append(alive)
    return out


def mixed_group(rank, ws, path):
    """backend=None with a GPU: "cpu:gloo,cuda:nccl"; each array goes to its device's backend."""
    if ws > 1:
        os.environ.update(one_gpu_env(rank))
    import cupy as cp

    import distlib as dist

    dist.init_process_group(init_method=f"file://{path}", rank=rank, world_size=ws, timeout=timedelta(seconds=60))
    pg = dist.distributed.get_default_group()
    host = np.full(3, rank + 1.0)
    dev = cp.asarray(np.full(3, rank + 1.0))
    dist.all_reduce(host)
    dist.all_reduce(dev)
    objects = [None] * ws
    dist.all_gather_object(objects, rank)  # host memory: the group has a CPU backend
    answer = (str(dist.get_backend()), float(host[0]), float(dev.get()[0]), objects,
              pg.backends["cpu"].name, pg.backends["cuda"].name, pg.backends["cuda"].comm is not None)
    dist.destroy_process_group()
    return answer


def gloo_with_cupy(rank, ws, path):
    """gloo takes cupy arrays for every collective, through host memory, ordered after the
    caller's stream (the same cases as the numpy ones, on cupy)."""
    dist, cp = _init(rank, ws, path, backend="gloo", device_id=None)
    problems = _Problems(rank)
    g = cp.asarray
    inputs = [make_input(r, "float32", 6 * ws) for r in range(ws)]
    mine = inputs[rank]
    total = reference("SUM", inputs)
    stream = cp.cuda.Stream(non_blocking=True)

    def all_reduce(async_op):
        with stream:
            x = cp.zeros(6 * ws, np.float32)
            x.set(mine, stream=stream)
            work = dist.all_reduce(x, async_op=async_op)
            if work is not None:
                work.wait()
            return _same(x.get(stream=stream), total)

    for async_op in (False, True):
        problems.case(f"all_reduce async={async_op}", lambda: all_reduce(async_op))

    def movement():
        x = g(mine)
        dist.broadcast(x, src=ws - 1)
        if _same(x.get(), inputs[ws - 1]):
            return "broadcast"
        x = g(mine)
        dist.reduce(x, dst=0)
        if rank == 0 and _same(x.get(), total):
            return "reduce"
        outs = [cp.zeros(6 * ws, np.float32) for _ in range(ws)]
        dist.all_gather(outs, g(mine))
        if any(_same(o.get(), inputs[k]) for k, o in enumerate(outs)):
            return "all_gather"
        out = cp.zeros(6 * ws * ws, np.float32)
        dist.all_gather_into_tensor(out, g(mine))
        if _same(out.get(), np.concatenate(inputs)):
            return "all_gather_into_tensor"
        outs = [cp.zeros(6 * ws, np.float32) for _ in range(ws)] if rank == 0 else None
        dist.gather(g(mine), outs, dst=0)
        if rank == 0 and any(_same(o.get(), inputs[k]) for k, o in enumerate(outs)):
            return "gather"
        out = cp.zeros(6 * ws, np.float32)
        dist.scatter(out, [g(inputs[k]) for k in range(ws)] if rank == 0 else None, src=0)
        if _same(out.get(), inputs[rank]):
            return "scatter"
        out = cp.zeros(6, np.float32)
        dist.reduce_scatter_tensor(out, g(mine))
        if _same(out.get(), total[rank * 6:(rank + 1) * 6]):
            return "reduce_scatter_tensor"
        out = cp.zeros(6, np.float32)
        dist.reduce_scatter(out, [g(mine[k * 6:(k + 1) * 6]) for k in range(ws)])
        if _same(out.get(), total[rank * 6:(rank + 1) * 6]):
            return "reduce_scatter"
        outs = [cp.zeros(6, np.float32) for _ in range(ws)]
        dist.all_to_all(outs, [g(mine[k * 6:(k + 1) * 6]) for k in range(ws)])
        if any(_same(o.get(), inputs[k][rank * 6:(rank + 1) * 6]) for k, o in enumerate(outs)):
            return "all_to_all"
        out = cp.zeros(6 * ws, np.float32)
        dist.all_to_all_single(out, g(mine))
        if _same(out.get(), np.concatenate([inputs[k][rank * 6:(rank + 1) * 6] for k in range(ws)])):
            return "all_to_all_single"
        box = cp.zeros(6 * ws, np.float32)
        if rank == 0 and ws > 1:
            dist.send(g(mine), dst=1)
        elif rank == 1:
            dist.recv(box, src=0)
            if _same(box.get(), inputs[0]):
                return "send/recv"
        dist.barrier()
        return None

    problems.case("every gloo collective on cupy", movement)
    dist.destroy_process_group()
    return list(problems)


def killed_mid_all_reduce(rank, ws, path, victim):
    """The victim dies with an all_reduce in flight; the others raise within the timeout,
    naming it (the store is a file, so it outlives any rank)."""
    dist, cp = _init(rank, ws, path, timeout_s=20)
    x = cp.asarray(np.ones(1 << 22, np.float32))
    dist.all_reduce(x)
    dist.barrier()
    if rank == victim:
        dist.all_reduce(x)
        time.sleep(0.05)
        os._exit(1)  # killed mid all_reduce, no goodbye
    time.sleep(1.0)  # the victim is gone by the time this rank's all_reduce is enqueued
    started = time.monotonic()
    try:
        dist.all_reduce(x)
        dist.barrier()  # blocks the host: raises once the watchdog has aborted
        text = "no error"
    except dist.DistBackendError as exc:
        text = str(exc)
    elapsed = time.monotonic() - started
    dist.destroy_process_group()
    return text, elapsed


def lazy_and_bound(rank, ws, path):
    """Without device_id the communicator is made at the first collective; LOCAL_RANK picks the
    device for a call without arrays; subgroups have communicators of their own."""
    os.environ["LOCAL_RANK"] = "0"
    dist, cp = _init(rank, ws, path, device_id=None)
    pg = dist.distributed.get_default_group()
    before = pg.backends["cuda"].comm is None
    dist.barrier()
    after = pg.backends["cuda"].comm is not None and pg.backends["cuda"].device == 0
    sub = dist.new_group(list(range(ws)))
    x = cp.asarray(np.full(2, rank + 1.0, np.float32))
    dist.all_reduce(x, group=sub)
    own = sub.backends["cuda"].comm is not pg.backends["cuda"].comm
    dist.destroy_process_group()
    return before, after, own, float(x.get()[0])
