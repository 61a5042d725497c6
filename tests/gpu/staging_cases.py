"""Rank functions for test_staging.py: every gloo collective through cuda_staging.HostStaged,
with numpy copies standing in for cupy's device<->host copies (module-level: pickled)."""

from __future__ import annotations

from datetime import timedelta

import numpy as np

from distlib.backends.cuda_staging import HostStaged
from distlib.distributed import get_default_group
from distlib.reduce_op import as_reduce_op
from tests.collectives.cases import close, make_input, reference


class NumpyCopies:
    """The staging protocol on numpy arrays: real copies, and a log of which arrays went which way."""

    def __init__(self):
        self.down, self.back, self.finished_calls = [], [], 0

    def to_host(self, array):
        self.down.append(id(array))
        return np.array(array, copy=True)

    @staticmethod
    def empty_host(array):
        return np.full(array.shape, 77, dtype=array.dtype)  # garbage, so a missing copy-down shows

    def to_device(self, host, array):
        self.back.append(id(array))
        np.copyto(array, host)

    def finished(self):
        self.finished_calls += 1


def _staged():
    copies = NumpyCopies()
    return HostStaged(get_default_group().backends["cpu"], copies), copies


def every_collective(rank, ws):
    """Run each collective staged; returns the problems found (empty when all is right)."""
    problems = []

    def expect(ok, what):
        if not ok:
            problems.append(f"rank {rank}: {what}")

    inputs = [make_input(r, "float32", 6) for r in range(ws)]
    mine = inputs[rank]

    for name in ("SUM", "MAX", "AVG"):
        staged, copies = _staged()
        a = mine.copy()
        staged.all_reduce(a, as_reduce_op(name))
        expect(close(a, reference(name, inputs)), f"all_reduce {name}: {a}")
        expect(copies.down == [id(a)] and copies.back == [id(a)] and copies.finished_calls == 1,
               f"all_reduce copies {copies.__dict__}")

    for root in range(ws):
        staged, copies = _staged()
        a = mine.copy()
        staged.broadcast(a, root)
        expect(np.array_equal(a, inputs[root]), f"broadcast from {root}")
        expect((copies.down, copies.back) == (([id(a)], []) if rank == root else ([], [id(a)])),
               f"broadcast copies {copies.__dict__}")

        staged, copies = _staged()
        a = mine.copy()
        staged.reduce(a, root, as_reduce_op("SUM"))
        expect(close(a, reference("SUM", inputs)) if rank == root else np.array_equal(a, mine), f"reduce to {root}")
        expect(copies.back == ([id(a)] if rank == root else []), "reduce copies back the root's only")

        staged, copies = _staged()
        outs = [np.zeros(6, np.float32) for _ in range(ws)] if rank == root else None
        staged.gather(outs, mine, root)
        if rank == root:
            expect(all(np.array_equal(outs[k], inputs[k]) for k in range(ws)), f"gather to {root}")

        staged, copies = _staged()
        out = np.zeros(6, np.float32)
        staged.scatter(out, [inputs[k] * 10 for k in range(ws)] if rank == root else None, root)
        expect(np.array_equal(out, mine * 10), f"scatter from {root}")

    staged, _ = _staged()
    outs = [np.zeros(6, np.float32) for _ in range(ws)]
    staged.all_gather(outs, mine)
    expect(all(np.array_equal(outs[k], inputs[k]) for k in range(ws)), "all_gather")

    staged, _ = _staged()
    out = np.zeros(6 * ws, np.float32)
    staged.all_gather_into(out, mine)
    expect(np.array_equal(out, np.concatenate(inputs)), "all_gather_into_tensor")

    big = [make_input(r, "float32", 6 * ws) for r in range(ws)]
    total = reference("SUM", big)
    staged, _ = _staged()
    out = np.zeros(6, np.float32)
    staged.reduce_scatter_into(out, big[rank], as_reduce_op("SUM"))
    expect(close(out, total[rank * 6:(rank + 1) * 6]), "reduce_scatter_tensor")

    staged, _ = _staged()
    out = np.zeros(6, np.float32)
    staged.reduce_scatter(out, [big[rank][k * 6:(k + 1) * 6].copy() for k in range(ws)], as_reduce_op("SUM"))
    expect(close(out, total[rank * 6:(rank + 1) * 6]), "reduce_scatter")

    staged, _ = _staged()
    outs = [np.zeros(2, np.int64) for _ in range(ws)]
    staged.all_to_all(outs, [np.array([rank, k], np.int64) for k in range(ws)])
    expect(all(outs[k].tolist() == [k, rank] for k in range(ws)), f"all_to_all {outs}")

    staged, _ = _staged()
    splits = [(r + k) % 2 + 1 for k in range(ws) for r in [rank]]
    data = np.arange(sum(splits) * 2, dtype=np.float64).reshape(-1, 2) + 100 * rank
    out_splits = [(k + rank) % 2 + 1 for k in range(ws)]
    out = np.zeros((sum(out_splits), 2), np.float64)
    staged.all_to_all_single(out, data, out_splits, splits)
    want = []
    for k in range(ws):
        theirs = [(k + j) % 2 + 1 for j in range(ws)]
        start = sum(theirs[:rank])
        want.append((np.arange(sum(theirs) * 2, dtype=np.float64).reshape(-1, 2) + 100 * k)[start:start + theirs[rank]])
    expect(np.array_equal(out, np.concatenate(want)), "all_to_all_single")

    staged, _ = _staged()
    staged.barrier()

    peer = (rank + 1) % ws
    source = (rank - 1) % ws
    staged, copies = _staged()
    box = np.zeros(3, np.int32)
    handle = staged.post_recv(box, source, 5)
    _staged()[0].send(np.full(3, rank, np.int32), peer, 5)
    got_from = handle.wait()
    expect(got_from == source and box.tolist() == [source] * 3, f"recv {box} from {got_from}")
    expect(copies.back == [id(box)] and copies.finished_calls == 1, "recv copies back once, on wait")
    return problems


def with_a_timeout(rank, ws):
    """The staged wrapper keeps the wrapped backend's identity and timeout."""
    staged, _ = _staged()
    inner = get_default_group().backends["cpu"]
    return staged.name == inner.name and staged.timeout == inner.timeout == timedelta(seconds=60)
