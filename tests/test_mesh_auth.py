"""The CPU backend's mesh with a job token (DISTLIB_AUTH_TOKEN): every connection proves the
token before a byte of it is read as a frame, and the listener binds only the address the rank
advertises. Real rank processes (and a real impostor process)."""

from __future__ import annotations

import logging
import os
import pickle
import re
import socket
import time
from datetime import timedelta

import pytest

from distlib.backends.gloo.transport.address import default_route_address
from tests.backends.procs import Proc
from tests.collectives.harness import WorkerPool
from tests.fixtures.ports import free_port

TOKEN = "mesh-token-" + "a" * 32
OTHER = "mesh-token-" + "b" * 32
MAGIC = b"DISTLIB-AUTH/1\n"


# -- what the rank processes run -------------------------------------------------------------------


def _collectives(rank, world_size):
    import numpy as np

    import distlib as dist
    from distlib.group import world

    array = np.full(8, rank + 1.0)
    dist.all_reduce(array)
    objects = [None] * world_size
    dist.all_gather_object(objects, {"rank": rank, "text": "x" * rank})
    mesh = world.default_pg.backends["cpu"].meshes[0]
    return array.tolist(), objects, mesh.token is not None


def _rank(rank, world_size, init_method, timeout_s, delay_s=0.0):
    """Join, run a collective and an object collective; report the mesh's WARNINGs and its
    listener's address. Errors come back as ("error", text) with the seconds init took."""
    import numpy as np

    import distlib as dist
    from distlib.group import world

    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("distlib.transport.tcp").addHandler(Keep())
    time.sleep(delay_s)
    started = time.monotonic()
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started,
                "warnings": warnings}
    init_s = time.monotonic() - started
    backend = world.default_pg.backends["cpu"]
    array = np.full(4, rank + 1.0)
    dist.all_reduce(array)
    objects = [None] * world_size
    dist.all_gather_object(objects, rank * 10)
    result = {"sum": array.tolist(), "objects": objects, "warnings": warnings, "init_s": init_s,
              "bound": backend.meshes[0].listener.getsockname()[:2],
              "advertised": backend.records[rank]["addresses"][0]}
    dist.destroy_process_group()
    return result


class _Unpickled:
    """What the impostor sends as a pickle: unpickling it would leave a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _impostor(port, ready, marker, connections):
    """Connect to a rank's mesh listener without the token, as rank 1, and send a HELLO and an
    object-collective frame at once; return what the listener sent back on each connection."""
    from distlib.backends.gloo.transport import frames

    hello = frames.pack(frames.HELLO, 0, 0, 0, 0, 0, 0, frames.HELLO_PAYLOAD.size) + frames.HELLO_PAYLOAD.pack(1, 0)
    payload = pickle.dumps(_Unpickled(marker))
    data = frames.pack(frames.DATA, frames.OPS["broadcast"], 0, 0, 0, 0, len(payload), len(payload)) + payload
    socks = []
    deadline = time.monotonic() + 60
    for _ in range(connections):
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=1.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        sock.sendall(hello + data)
        socks.append(sock)
    open(ready, "w").close()
    replies = []
    for sock in socks:
        sock.settimeout(60)
        got = b""
        try:
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                got += chunk
        except ConnectionResetError:
            pass  # the listener closed with the impostor's unread bytes in its buffer
        sock.close()
        replies.append(got)
    return replies


# -- the tests ---------------------------------------------------------------------------------------


def test_a_mesh_with_a_token_runs_collectives_and_object_collectives_over_tcp():
    pool = WorkerPool(3, init="tcp", env={"DISTLIB_AUTH_TOKEN": TOKEN, "DISTLIB_SHM": "0"}, timeout_s=30)
    try:
        results = pool.run(_collectives)
    finally:
        pool.close()
    for array, objects, authenticated in results:
        assert array == [6.0] * 8
        assert objects == [{"rank": r, "text": "x" * r} for r in range(3)]
        assert authenticated


def test_an_impostor_without_the_token_is_refused_logged_once_and_the_job_completes(tmp_path):
    store_port, mesh_port = free_port(), free_port()
    init = f"tcp://127.0.0.1:{store_port}"
    ready, marker = str(tmp_path / "ready"), str(tmp_path / "unpickled")
    rank0 = Proc(_rank, 0, 2, init, 60.0,
                 env={"DISTLIB_AUTH_TOKEN": TOKEN, "DISTLIB_SHM": "0", "DISTLIB_PORT_RANGE": f"{mesh_port}-{mesh_port}"})
    impostor = Proc(_impostor, mesh_port, ready, marker, 2, env={"DISTLIB_AUTH_TOKEN": None})
    deadline = time.monotonic() + 60
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(ready), "the impostor never reached rank 0's mesh listener"
    # both impostor connections wait in rank 0's backlog, ahead of the real rank 1
    rank1 = Proc(_rank, 1, 2, init, 60.0, env={"DISTLIB_AUTH_TOKEN": TOKEN, "DISTLIB_SHM": "0"})
    status0, result0 = rank0.result(90)
    status1, result1 = rank1.result(90)
    status_i, replies = impostor.result(30)
    assert status0 == "ok" and "error" not in result0, result0
    assert status1 == "ok" and "error" not in result1, result1
    assert result0["sum"] == result1["sum"] == [3.0] * 4
    # one at a time, rank 0 would have given each silent connection its 5 s: 20 s in all
    assert result0["init_s"] < 10.0, result0["init_s"]
    assert result0["objects"] == result1["objects"] == [0, 10]
    assert status_i == "ok", replies
    for reply in replies:  # a challenge (and a refusal, unless the close raced it), never a frame
        assert reply[:len(MAGIC)] == MAGIC, reply
        assert reply[47:] in (b"", b"\x01"), reply
    refusals = [w for w in result0["warnings"] if "refused a mesh connection from 127.0.0.1:" in w]
    assert len(refusals) == 1, result0["warnings"]  # two refused connections, one WARNING
    assert "failed authentication" in refusals[0] and "nothing it sent was read" in refusals[0], refusals
    assert not os.path.exists(marker)


def test_a_rank_with_a_wrong_token_fails_at_once_and_its_peer_names_the_refusal(tmp_path):
    init = f"file://{tmp_path}/store"
    rank0 = Proc(_rank, 0, 2, init, 6.0, env={"DISTLIB_AUTH_TOKEN": TOKEN, "DISTLIB_SHM": "0"})
    rank1 = Proc(_rank, 1, 2, init, 30.0, env={"DISTLIB_AUTH_TOKEN": OTHER, "DISTLIB_SHM": "0"})
    _, result1 = rank1.result(60)
    _, result0 = rank0.result(60)
    assert "could not authenticate its mesh connection to rank 0 at " in result1["error"], result1
    assert "wrong token" in result1["error"], result1
    assert result1["seconds"] < 15.0, result1  # at once, not at its 30 s timeout
    assert re.search(r"waited 6\.0s for ranks 1 \([^)]*:\d+\) to connect", result0["error"]), result0
    assert "refused connections that failed authentication: 1 from " in result0["error"], result0
    assert any("refused a mesh connection" in w for w in result0["warnings"]), result0


def test_a_rank_without_the_token_is_told_its_peer_requires_authentication(tmp_path):
    init = f"file://{tmp_path}/store"
    rank0 = Proc(_rank, 0, 2, init, 20.0, env={"DISTLIB_AUTH_TOKEN": TOKEN, "DISTLIB_SHM": "0"})
    rank1 = Proc(_rank, 1, 2, init, 20.0, env={"DISTLIB_AUTH_TOKEN": None, "DISTLIB_SHM": "0"})
    _, result1 = rank1.result(60)
    _, result0 = rank0.result(60)
    assert "AuthError: pg0/gloo: rank 0 at " in result1["error"], result1
    assert "requires authentication (DISTLIB_AUTH_TOKEN is set there), but rank 1 has no DISTLIB_AUTH_TOKEN" \
        in result1["error"], result1
    assert "rank 0 has DISTLIB_AUTH_TOKEN, but rank 1 at " in result0["error"], result0
    assert result0["seconds"] < 10 and result1["seconds"] < 10, (result0, result1)


def _address_job(bind_all):
    host = default_route_address()
    init = f"tcp://{host}:{free_port()}"
    env = {"DISTLIB_SHM": "0", "DISTLIB_MESH_BIND_ALL": "1" if bind_all else None}
    procs = [Proc(_rank, r, 2, init, 30.0, env=env) for r in range(2)]
    return host, [p.result(60) for p in procs]


def test_the_mesh_listener_binds_the_address_the_rank_advertises():
    host, results = _address_job(bind_all=False)
    if host == "127.0.0.1":
        pytest.skip("this host has no address but loopback")
    for status, result in results:
        assert status == "ok" and "error" not in result, result
        assert result["advertised"][0] == host
        assert tuple(result["bound"]) == (host, result["advertised"][1])


def test_distlib_mesh_bind_all_binds_every_interface():
    _, results = _address_job(bind_all=True)
    for status, result in results:
        assert status == "ok" and "error" not in result, result
        assert tuple(result["bound"]) == ("0.0.0.0", result["advertised"][1])


def _silent(port, ready, connections, hold_s):
    """Open connections to a rank's mesh listener and send nothing on them for ``hold_s``."""
    socks = []
    deadline = time.monotonic() + 60
    while len(socks) < connections:
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=1.0))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    open(ready, "w").close()
    time.sleep(hold_s)
    for sock in socks:
        sock.close()
    return connections


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
def test_silent_connections_ahead_of_the_real_peer_hold_up_nobody(tmp_path, token):
    """Four connections that never say a word wait in rank 0's backlog before rank 1 arrives.
    Each may take 5 s (AUTH_REPLY_S) to give up on: taken one at a time they held rank 0's init
    for 20 s; side by side they cost the real peer nothing."""
    store_port, mesh_port = free_port(), free_port()
    init = f"tcp://127.0.0.1:{store_port}"
    ready = str(tmp_path / "ready")
    env = {"DISTLIB_AUTH_TOKEN": token, "DISTLIB_SHM": "0"}
    rank0 = Proc(_rank, 0, 2, init, 30.0, env=dict(env, DISTLIB_PORT_RANGE=f"{mesh_port}-{mesh_port}"))
    silent = Proc(_silent, mesh_port, ready, 4, 60.0, env={"DISTLIB_AUTH_TOKEN": None})
    deadline = time.monotonic() + 60
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(ready), "the silent client never reached rank 0's mesh listener"
    rank1 = Proc(_rank, 1, 2, init, 30.0, env=env)
    try:
        status0, result0 = rank0.result(90)
        status1, result1 = rank1.result(90)
    finally:
        silent.process.kill()  # its connections were silent all along
        silent.process.join(10)
    assert status0 == "ok" and "error" not in result0, result0
    assert status1 == "ok" and "error" not in result1, result1
    assert result0["sum"] == result1["sum"] == [3.0] * 4
    # one at a time, rank 0 would have given each silent connection its 5 s: 20 s in all
    assert result0["init_s"] < 10.0, result0["init_s"]
