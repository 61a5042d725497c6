"""Functions for fresh processes (harness.spawn): init/destroy cycles, plugins, failures."""

import os
import time
from datetime import timedelta

import numpy as np


def init_destroy_init(rank, ws, path1, path2):
    import distlib as dist

    out = []
    for path in (path1, path2):
        dist.init_process_group("GLOO", init_method=f"file://{path}", rank=rank, world_size=ws,
                                timeout=timedelta(seconds=30))
        a = np.full(3, rank + 1.0)
        dist.all_reduce(a)
        out.append((dist.is_initialized(), float(a[0]), dist.get_backend()))
        dist.destroy_process_group()
        out.append(dist.is_initialized())
    return out


def after_failure_reinit(rank, ws, path1, path2):
    """A collective that fails (mismatch) breaks the group; destroy and init again works."""
    import distlib as dist

    dist.init_process_group("gloo", init_method=f"file://{path1}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    try:
        dist.all_reduce(np.ones(5 + rank))
        failed = False
    except dist.DistBackendError:
        failed = True
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{path2}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    a = np.ones(2)
    dist.all_reduce(a)
    dist.destroy_process_group()
    return failed, float(a[0])


def use_plugin(rank, ws, path):
    import distlib as dist

    from tests.collectives import plugin_backend

    dist.Backend.register_backend("storebackend", plugin_backend.create, devices=["cpu"])
    dist.init_process_group("storebackend", init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    a = np.arange(4, dtype=np.float64) * (rank + 1)
    dist.all_reduce(a, op=dist.ReduceOp.MAX)
    dist.barrier()
    backend = dist.get_backend()
    try:
        dist.broadcast(np.zeros(2), src=0)
        unsupported = "no error"
    except NotImplementedError as exc:
        unsupported = str(exc)
    dist.destroy_process_group()
    return a.tolist(), backend, dist.Backend.STOREBACKEND, unsupported


def join_with_missing_rank(rank, ws, port):
    """Ranks 0..ws-2 start; the last never does. Every started rank must fail within the
    timeout (plus a margin) with an error naming the missing rank."""
    import distlib as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ws + 1),
                      LOCAL_WORLD_SIZE=str(ws + 1), GROUP_RANK="0")
    start = time.monotonic()
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=4))
        return "joined?!", 0.0
    except dist.DistError as exc:
        return str(exc), time.monotonic() - start


def killed_during_all_reduce(rank, ws, port, victim):
    """The victim SIGKILLs itself in the middle of a large all_reduce; the others must raise
    DistBackendError naming it, well within the group timeout, and exit."""
    import signal
    import threading

    import distlib as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ws),
                      DISTLIB_SHM="0")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    big = np.ones(32 << 20, np.float32)  # 128 MiB: several hundred ms per all_reduce here
    dist.all_reduce(np.ones(1))
    if rank == victim:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        for _ in range(50):
            dist.all_reduce(big)
        return "no error", time.monotonic() - start
    except dist.DistBackendError as exc:
        return str(exc), time.monotonic() - start


def port_range_init(rank, ws, path, low, high):
    import distlib as dist

    os.environ["DISTLIB_PORT_RANGE"] = f"{low}-{high}"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    from distlib.distributed import get_default_group

    mesh = get_default_group().backends["cpu"].meshes[0]
    port = mesh.listener.getsockname()[1]
    a = np.ones(2)
    dist.all_reduce(a)
    dist.destroy_process_group()
    return port, float(a[0])


def busy_port_range(rank, ws, path, port):
    import socket

    import distlib as dist

    blocker = socket.socket()
    blocker.bind(("0.0.0.0", port))
    blocker.listen()
    os.environ["DISTLIB_PORT_RANGE"] = f"{port}-{port}"
    try:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=ws,
                                timeout=timedelta(seconds=5))
        return "no error"
    except dist.DistError as exc:
        return str(exc)
    finally:
        blocker.close()


def two_interfaces(rank, ws, path):
    import distlib as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo,lo"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    from distlib.distributed import get_default_group

    meshes = len(get_default_group().backends["cpu"].meshes)
    results = []
    for i in range(4):  # alternate between the two meshes
        a = np.full(8, float(rank + i))
        dist.all_reduce(a)
        results.append(float(a[0]))
    dist.destroy_process_group()
    return meshes, results
