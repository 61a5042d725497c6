"""Rank functions for test_nccl_fake.py: the nccl backend on the fake device (fake_cuda.py),
in fresh processes (harness.spawn; module-level so they pickle). Each returns what the test
asserts on, with the fake's violations (unsafe use of a communicator) beside it. The same
functions run on a real GPU (test_nccl_gpu.py) with ``where`` starting "gpu:": real cupy,
ranks sharing GPU 0 (gpu_cases.one_gpu_env), no fake and so no violations to report."""

from __future__ import annotations

import os
import time
import types
from datetime import timedelta

import numpy as np


def _init(rank, ws, where, store, device_id, timeout_s, **fake):
    """The fake in this process (or, for a "gpu:" ``where``, the real GPU), then
    init_process_group("nccl") through ``store`` (file or env); returns (dist, device) where
    ``device.cupy`` is the array module and ``device.violations`` what the fake caught."""
    if where.startswith("gpu:"):
        import faulthandler

        faulthandler.enable()  # a native crash prints every thread's Python stack
        where = where[len("gpu:"):]
        from .gpu_cases import one_gpu_env

        if ws > 1:
            os.environ.update(one_gpu_env(rank))
        import cupy

        cupy.cuda.Device(0).use()
        device = types.SimpleNamespace(cupy=cupy, violations=[])
    else:
        from distlib.testing.fake_gpu import cuda as fake_cuda

        device = fake_cuda.install(os.path.join(where, "fake"), **fake)
    import distlib as dist

    if store == "env":
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws))  # MASTER_ADDR/PORT come from the test
        init_method = "env://"
    else:
        init_method = f"file://{os.path.join(where, 'store')}"
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=ws,
                            timeout=timedelta(seconds=timeout_s), device_id=device_id)
    return dist, device


def _dir(where):
    return where[len("gpu:"):] if where.startswith("gpu:") else where


def _signal(where, name):
    open(os.path.join(_dir(where), name), "w").close()


def _wait_for(where, names, seconds):
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(os.path.join(_dir(where), n)) for n in names):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def destroy_after_all_reduce(rank, ws, where, device_id, subgroup, count=4):
    """all_reduce (on the fake, its kernel held back 1 s; on a GPU, ``count`` elements), then
    destroy at once: the result must be there. Returns the distinct values read afterwards."""
    dist, fake = _init(rank, ws, where, "file", device_id, 30, delays={1: 1.0})
    group = dist.new_group(list(range(ws))) if subgroup else None
    x = fake.cupy.asarray(np.full(count, rank + 1.0, np.float32))
    dist.all_reduce(x, group=group)
    started = time.monotonic()
    dist.destroy_process_group(group)
    took = time.monotonic() - started
    value = sorted(set(x.get().tolist()))
    if subgroup:
        dist.destroy_process_group()
    return value, took, list(fake.violations)


def silent_rank(rank, ws, where, store, device_id, laggard, how, timeout_s, enqueue_s, pause_s=0.0):
    """The laggard issues #1 and #2 and then goes silent (sleeps, or exits); the others issue #3
    and then either block in barrier() (the GPU test's steps) or keep enqueueing all_reduces, as
    a training loop does, while their watchdog fires. Returns the error, its time, whether the
    next call raises the same, how long destroy took, and the fake's violations."""
    dist, fake = _init(rank, ws, where, store, device_id, timeout_s, enqueue_s=enqueue_s, on_violation="crash")
    x = fake.cupy.asarray(np.ones(4, np.float32))
    dist.all_reduce(x)  # 1
    dist.all_reduce(x)  # 2
    x.get()  # both finished everywhere
    survivors = [f"done.{r}" for r in range(ws) if r != laggard]
    living = survivors if how == "exit" else [f"done.{r}" for r in range(ws)]
    if rank == laggard:
        if how == "exit":
            os._exit(3)
        _wait_for(where, survivors, 4 * timeout_s + 60)  # silent until the others are through
        started = time.monotonic()
        dist.destroy_process_group()
        took = time.monotonic() - started
        _signal(where, f"done.{rank}")
        return "silent", 0.0, True, took, list(fake.violations)
    started = time.monotonic()
    try:
        dist.all_reduce(x)  # 3: enqueued; the laggard never joins it
        if how == "loop":
            while time.monotonic() - started < 3 * timeout_s + 30:
                dist.all_reduce(x)
                time.sleep(pause_s)
        dist.barrier()
        text = "no error"
    except dist.DistBackendError as exc:
        text = str(exc)
    elapsed = time.monotonic() - started
    try:
        dist.all_reduce(x)
        again = "no error"
    except dist.DistBackendError as exc:
        again = str(exc)
    # every survivor has its diagnosis before rank 0's destroy closes the store it hosts (env://)
    _signal(where, f"failed.{rank}")
    _wait_for(where, [f"failed.{r}" for r in range(ws) if r != laggard], 4 * timeout_s + 60)
    started = time.monotonic()
    dist.destroy_process_group()
    took = time.monotonic() - started
    _signal(where, f"done.{rank}")
    _wait_for(where, living, 4 * timeout_s + 60)  # rank 0 may host the store: everyone is through first
    return text, elapsed, text in again and "aborted by an earlier failure" in again, took, list(fake.violations)


def silent_rank_problems(values, ws, laggard, how, timeout_s):
    """What is wrong with silent_rank's answers (the exited rank's left out): [] when each
    survivor raised the watchdog's error naming the laggard within the timeout and a few
    seconds, refused the next call naming it, destroyed at once, and every destroy returned."""
    problems = []
    ranks = [r for r in range(ws) if not (how == "exit" and r == laggard)]
    for rank, (text, elapsed, same_again, took, violations) in zip(ranks, values, strict=True):
        if violations:
            problems.append(f"rank {rank}: the fake saw {violations}")
        if rank == laggard:
            if took >= 10:
                problems.append(f"the silent rank's destroy took {took:.1f}s")
            continue
        # its own watchdog's timeout, or the abort of another survivor that timed out first
        timed_out = "(collective #3 in this group) timed out after" in text
        if not (timed_out or "(collective #3 in this group) failed: NCCL reported" in text):
            problems.append(f"rank {rank}: not the watchdog's error for #3: {text}")
        if f"Ranks that had not reached #3: rank {laggard} on " not in text:
            problems.append(f"rank {rank}: rank {laggard} is not named as behind: {text}")
        elif how == "exit":  # gone within a heart-beat of #2: its record may be older than that
            if f"rank {laggard} on " not in text.partition("No heart-beat")[2]:
                problems.append(f"rank {rank}: rank {laggard} is not named as silent: {text}")
        elif "last issued #2" not in text:
            problems.append(f"rank {rank}: rank {laggard}'s last collective (#2) is not said: {text}")
        if not (timeout_s if timed_out else 0) <= elapsed < timeout_s + 10:
            problems.append(f"rank {rank}: the error came after {elapsed:.1f}s (timeout {timeout_s}s)")
        if not same_again:
            problems.append(f"rank {rank}: the next call did not refuse, naming the error")
        if took >= 5:
            problems.append(f"rank {rank}: destroy after the failure took {took:.1f}s")
    return problems


def abort_discards(rank, ws, where):
    """_abort_process_group with an all_reduce held back: returns at once, the result is not
    written, and the group is gone."""
    dist, fake = _init(rank, ws, where, "file", 0, 30, delays={1: 5.0})
    x = fake.cupy.asarray(np.full(2, rank + 1.0, np.float32))
    work = dist.all_reduce(x, async_op=True)
    started = time.monotonic()
    dist.distributed._abort_process_group()
    took = time.monotonic() - started
    try:
        work.wait()
        waited = "no error"
    except dist.DistBackendError as exc:
        waited = str(exc)
    return x.get().tolist(), took, waited, dist.is_initialized(), list(fake.violations)


def refusals(rank, ws, where):
    """gpu_cases.refusals on the fake: the texts users read, and nothing enqueued."""
    from . import gpu_cases

    dist, fake = _init(rank, ws, where, "file", 0, 30)
    return gpu_cases.refusals_on(dist, fake.cupy, ws) + (list(fake.violations),)


def mismatch_stays_failed(rank, ws, where, timeout_s):
    """all_reduce of float32[4] on rank 0 against float32[8] on the others (issue 37). NCCL
    checks no counts: its ranks wait for each other (the fake too), until the watchdog's
    timeout fails the group on every rank. Then every later operation is refused at once,
    naming that failure, until the group is destroyed. Returns (the first error, [(operation,
    its error or "no error")], seconds the destroy took, the fake's violations)."""
    dist, fake = _init(rank, ws, where, "file", 0, timeout_s)
    cp = fake.cupy
    first = "no error"
    try:
        dist.all_reduce(cp.asarray(np.ones(4 if rank == 0 else 8, np.float32)))
        dist.barrier()  # blocks the host until the device has run it, or the group failed
    except dist.DistBackendError as exc:
        first = str(exc)
    x = cp.asarray(np.ones(4, np.float32))
    later_calls = [
        ("all_reduce", lambda: dist.all_reduce(x)),
        ("broadcast", lambda: dist.broadcast(x, src=0)),
        ("barrier", lambda: dist.barrier()),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(cp.asarray(np.zeros(4 * ws, np.float32)), x)),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(cp.asarray(np.zeros(2, np.float32)),
                                                                     cp.asarray(np.ones(2 * ws, np.float32)))),
        ("send/recv", lambda: dist.send(x, dst=1) if rank == 0 else dist.recv(x, src=0)),
    ]
    later = []
    for name, call in later_calls:
        try:
            call()
            later.append((name, "no error"))
        except dist.DistBackendError as exc:
            later.append((name, str(exc)))
    started = time.monotonic()
    dist.destroy_process_group()
    return first, later, time.monotonic() - started, list(fake.violations)
