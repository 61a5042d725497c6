"""Rank-side functions for the small-collective paths: the same-host channel (both sides of
its size threshold), the TCP algorithms for small arrays, async order, failures."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np

import distlib as dist
from distlib.distributed import get_default_group

from .cases import as_op, close, digest, make_input, on_a_fresh_subgroup, reference, valid


def _backend(group=None):
    pg = get_default_group() if group is None else group
    return pg.backends["cpu"]


def _exchanges(group=None) -> int:
    """Exchanges this rank has made through the group's channel (-1: it has none)."""
    small = _backend(group).small
    return -1 if small is None else small.exchanges


def channel_facts(rank, ws):
    """Whether the group has a channel, its slot size, and the wait policy it decided on."""
    from distlib.cpus import usable_cpus

    small = _backend().small
    if small is None:
        return None
    return {"slot": small.slot_bytes, "spin": small.policy.spin_s, "yield": small.policy.yield_s,
            "cpus": usable_cpus()}


def _through_channel(fn) -> bool:
    before = _exchanges()
    fn()
    return _exchanges() == before + 1


def all_reduce_at_threshold(rank, ws, op_name, dtypes, slot):
    """all_reduce of the largest array that fits a slot, and of one element more: (dtype,
    count, result ok, went through the channel, digest) for each."""
    out = []
    for dtype in dtypes:
        if not valid(op_name, dtype):
            continue
        fit = slot // np.dtype(dtype).itemsize
        for n in (fit, fit + 1):
            inputs = [make_input(r, dtype, n, op_name) for r in range(ws)]
            array = inputs[rank].copy()
            used = _through_channel(lambda: dist.all_reduce(array, op=as_op(op_name)))
            out.append((dtype, n, close(array, reference(op_name, inputs)), used, digest(array)))
    return out


def every_collective_at_threshold(rank, ws, dtype, slot):
    """Each collective the channel carries, at the largest size that fits and one element
    more: {name: [(ok, went through the channel), (ok, ...)]}."""
    dt = np.dtype(dtype)
    results = {}

    def record(name, ok, used):
        results.setdefault(name, []).append((bool(ok), used))

    for over in (0, 1):
        n = slot // dt.itemsize + over  # per-rank contribution of broadcast/reduce/gathers
        m = slot // (ws * dt.itemsize) + over  # per-rank piece of scatter/reduce_scatter
        mine = make_input(rank, dtype, n)
        everyone = [make_input(r, dtype, n) for r in range(ws)]
        for root in sorted({0, ws - 1}):
            data = make_input(root, dtype, n)
            array = data.copy() if rank == root else np.zeros(n, dt)
            used = _through_channel(lambda: dist.broadcast(array, src=root))
            record(f"broadcast from {root}", np.array_equal(array, data), used)
            work = mine.copy()
            used = _through_channel(lambda: dist.reduce(work, dst=root))
            record(f"reduce to {root}", close(work, reference("SUM", everyone)) if rank == root
                   else np.array_equal(work, mine), used)
            gathered = [np.empty(n, dt) for _ in range(ws)] if rank == root else None
            used = _through_channel(lambda: dist.gather(mine, gathered, dst=root))
            record(f"gather to {root}", all(np.array_equal(g, e) for g, e in zip(gathered, everyone, strict=True))
                   if rank == root else True, used)
            pieces = [make_input(100 + k, dtype, m) for k in range(ws)]
            received = np.empty(m, dt)
            used = _through_channel(lambda: dist.scatter(received, pieces if rank == root else None, src=root))
            record(f"scatter from {root}", np.array_equal(received, pieces[rank]), used)
        outputs = [np.empty(n, dt) for _ in range(ws)]
        used = _through_channel(lambda: dist.all_gather(outputs, mine))
        record("all_gather", all(np.array_equal(o, e) for o, e in zip(outputs, everyone, strict=True)), used)
        flat = np.empty(n * ws, dt)
        used = _through_channel(lambda: dist.all_gather_into_tensor(flat, mine))
        record("all_gather_into_tensor", np.array_equal(flat, np.concatenate(everyone)), used)
        full = [make_input(r, dtype, m * ws) for r in range(ws)]
        expect = reference("SUM", full)[rank * m:(rank + 1) * m]
        out = np.empty(m, dt)
        source = full[rank].copy()
        used = _through_channel(lambda: dist.reduce_scatter_tensor(out, source))
        record("reduce_scatter_tensor", close(out, expect) and np.array_equal(source, full[rank]), used)
        out2 = np.empty(m, dt)
        used = _through_channel(lambda: dist.reduce_scatter(out2, [full[rank][k * m:(k + 1) * m].copy()
                                                                   for k in range(ws)]))
        record("reduce_scatter", close(out2, expect), used)
    results["barrier"] = [(True, _through_channel(dist.barrier))]
    return results


def async_mixed_with_sync(rank, ws, slot):
    """Async operations, small and large, interleaved with sync ones on the same group: every
    value shows that each ran after everything issued before it."""
    works = []
    a = np.ones(4, np.float64)
    works.append(dist.all_reduce(a, async_op=True))             # a = ws
    dist.all_reduce(a)                                          # after it: a = ws^2
    b = np.full(3, float(rank))
    works.append(dist.broadcast(b, src=ws - 1, async_op=True))   # b = ws - 1
    works.append(dist.all_reduce(b, async_op=True))             # b = ws (ws - 1)
    big = np.ones(slot // 4 + 1, np.float32)
    works.append(dist.all_reduce(big, async_op=True))           # not through the channel
    c = np.full(2, float(rank + 1))
    dist.all_reduce(c, op=dist.ReduceOp.MAX)                    # c = ws
    works.append(dist.all_reduce(c, async_op=True))             # c = ws^2
    works.append(dist.barrier(async_op=True))
    gathered = np.empty(ws, np.float64)
    dist.all_gather_into_tensor(gathered, c[:1])                # reads c after all of the above
    for w in works:
        w.wait()
    return {
        "a": float(a[0]), "b": float(b[0]), "big": float(big[0]), "c": float(c[0]),
        "gathered": gathered.tolist(),
        "works_done": all(w.is_completed() and w.is_success() for w in works),
    }


def sync_calls_start_no_thread(rank, ws):
    """A fresh group that only runs sync collectives never starts its executor thread (no
    hand-off); the first async one does."""
    group = dist.new_group(list(range(ws)))
    a = np.ones(3)
    for _ in range(20):
        dist.all_reduce(a, group=group)
        dist.broadcast(a, src=0, group=group)
        dist.barrier(group=group)
    no_thread = group.executor._thread is None
    dist.all_reduce(a, group=group, async_op=True).wait()
    thread = group.executor._thread is not None
    dist.destroy_process_group(group)
    return no_thread, thread, float(a[0])


def all_reduce_matrix_with(rank, ws, algorithm, op_name, dtypes, sizes):
    """cases.all_reduce_matrix with the TCP all_reduce algorithm forced to ``algorithm``."""
    from distlib.backends.gloo import sizes as gloo_sizes

    from .cases import all_reduce_matrix

    chosen = gloo_sizes.choose_all_reduce
    gloo_sizes.choose_all_reduce = lambda nbytes, n, crowded=False: algorithm
    try:
        return all_reduce_matrix(rank, ws, op_name, dtypes, sizes)
    finally:
        gloo_sizes.choose_all_reduce = chosen


def mismatch_with_algorithm(rank, ws, algorithm, kind):
    """cases.mismatched_collectives with the TCP all_reduce algorithm forced."""
    from distlib.backends.gloo import sizes as gloo_sizes

    from .cases import mismatched_collectives

    chosen = gloo_sizes.choose_all_reduce
    gloo_sizes.choose_all_reduce = lambda nbytes, n, crowded=False: algorithm
    try:
        return mismatched_collectives(rank, ws, kind)
    finally:
        gloo_sizes.choose_all_reduce = chosen


def killed_during_small_collectives(rank, ws, port, victim, asleep):
    """Small all_reduces through the channel; the victim SIGKILLs itself, either in the
    middle of the loop or (``asleep``) after idling long enough that the others sleep in the
    kernel waiting for it. The others must raise naming it, and exit."""
    import signal
    import threading

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ws))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    channel = _backend().small is not None
    a = np.ones(4)
    dist.all_reduce(a)
    start = time.monotonic()
    if rank == victim:
        if asleep:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        while time.monotonic() - start < 50:
            dist.all_reduce(a)
        return "no error", time.monotonic() - start, channel
    except dist.DistBackendError as exc:
        return str(exc), time.monotonic() - start, channel


def silent_rank_in_small_collective(rank, ws, path, silent):
    """Rank ``silent`` stops taking part (stuck outside distlib); the others wait for it in
    the channel. Their timeout must name it as the silent one, and only it."""
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=6))
    a = np.ones(4)
    dist.all_reduce(a)
    if rank == silent:
        time.sleep(11)
        return "slept", 0.0, True
    start = time.monotonic()
    try:
        dist.all_reduce(a)
        return "no error", time.monotonic() - start, _backend().small is not None
    except dist.DistBackendError as exc:
        return str(exc), time.monotonic() - start, True


def mismatch_across_the_threshold(rank, ws, kind, slot):
    """On a fresh subgroup, rank 0's operation goes through the channel and the others' do
    not (or the reverse): every rank must raise, saying why."""
    fits = slot // 4

    def body(group):
        if kind == "sizes":  # rank 0 fits the slot, the others have one element more
            dist.all_reduce(np.ones(fits + (rank > 0), np.float32), group=group)
        elif kind == "large_broadcast":  # rank 0 small all_reduce, the others a large broadcast
            if rank == 0:
                dist.all_reduce(np.ones(8, np.float32), group=group)
            else:
                dist.broadcast(np.ones(fits * 4, np.float32), src=0, group=group)
        elif kind == "small_vs_large_first":  # the ranks outside the channel announce first
            if rank == 0:
                time.sleep(0.3)
                dist.all_reduce(np.ones(8, np.float32), group=group)
            else:
                dist.all_reduce(np.ones(fits * 4, np.float32), group=group)

    return on_a_fresh_subgroup(ws, body)


def random_waits_all_reduce(rank, ws, rounds):
    """Small all_reduces where one rank at a time arrives late (so the others wait, and with
    the blocking policy, sleep in the kernel): every result is checked."""
    rng = np.random.default_rng(7)
    wrong = 0
    for i in range(rounds):
        late = int(rng.integers(0, ws))
        pause = float(rng.uniform(0, 0.004))
        if rank == late:
            time.sleep(pause)
        a = np.full(5, float(rank + i))
        dist.all_reduce(a)
        wrong += int(not np.all(a == sum(r + i for r in range(ws))))
    return wrong, _exchanges()
