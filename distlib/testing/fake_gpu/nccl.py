"""The fake's ``cupy.cuda.nccl``: module functions and ``NcclCommunicator`` (see cuda.py
for what is modelled and why). Ranks are processes; a communicator's operations meet through
files in the fake's shared directory: ``<dir>/comm-<id>/c<seq>.<rank>`` holds rank's part of
collective #seq, ``p<src>-<dst>.<n>`` the n-th message from src to dst, ``aborted.<rank>``
says that rank aborted. Cupy's own behaviour is kept where the backend can see it: abort() and
destroy() of a communicator already aborted or destroyed do nothing; any other call then
fails with NcclError (cupy passes NCCL a null communicator)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np

available = True
_cuda: Any = None  # the fake device (cuda.py), bound at its import

_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16,
           7: np.float32, 8: np.float64}
_SUM, _PROD, _MAX, _MIN, _AVG = range(5)


def bind(fake_cuda) -> None:
    global _cuda
    _cuda = fake_cuda


class NcclError(RuntimeError):
    def __init__(self, text: str):
        super().__init__(text)
        self.status = text.split(":")[0]


def get_version() -> int:
    return 22809


def get_unique_id() -> bytes:
    return os.urandom(128)


_group = threading.local()


def groupStart() -> None:  # noqa: N802 - NCCL's name
    _group.depth = getattr(_group, "depth", 0) + 1
    if _group.depth == 1:
        _group.ops = []


def groupEnd() -> None:  # noqa: N802
    _group.depth -= 1
    if _group.depth == 0:
        by_comm: Dict[int, List] = {}
        for comm, op in _group.ops:
            by_comm.setdefault(id(comm), [comm]).append(op)
        for comm, *ops in by_comm.values():
            comm._enqueue(None, ("group", ops))


def _reduce(op: int, parts: List[np.ndarray]) -> np.ndarray:
    out = parts[0].copy()
    for part in parts[1:]:
        if op in (_SUM, _AVG):
            out += part
        elif op == _PROD:
            out *= part
        elif op == _MAX:
            np.maximum(out, part, out=out)
        else:
            np.minimum(out, part, out=out)
    if op == _AVG:
        out[...] = out / len(parts)
    return out


class NcclCommunicator:
    def __init__(self, ndev: int, commId, rank: int):  # noqa: N803 - cupy's names
        raw = bytes(x & 0xFF for x in commId) if isinstance(commId, tuple) else bytes(commId)
        self.world, self.me = int(ndev), int(rank)
        self.dir = os.path.join(str(_cuda._config["dir"]), f"comm-{raw[:8].hex()}") if ndev > 1 else None
        self._guard = threading.Condition()
        self._inside: Dict[int, str] = {}
        self._state = "live"
        self._aborted = threading.Event()
        self._async: Optional[str] = None
        self._collectives = 0
        self._sent: Dict[int, int] = {}
        self._received: Dict[int, int] = {}
        self._queued = 0
        if self.dir:
            os.makedirs(self.dir, exist_ok=True)
            self._post(f"init.{self.me}", b"")
            deadline = time.monotonic() + 300
            while not all(os.path.exists(self._path(f"init.{r}")) for r in range(self.world)):
                if time.monotonic() > deadline:
                    raise NcclError("ncclInternalError: fake ncclCommInitRank waited 300s for the other ranks")
                time.sleep(_cuda._POLL_S)

    # -- the rules of use ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _call(self, name: str):
        me = threading.get_ident()
        with self._guard:
            if self._state != "live":
                _cuda._violation(f"{name}() on a communicator after its {self._state} (cupy hands NCCL a null or "
                                 f"freed communicator)")
                raise NcclError(f"ncclInvalidArgument: {name} on a {self._state} communicator")
            for thread, other in self._inside.items():
                if thread == me:
                    continue
                if "check_async_error" in (name, other) and "abort" not in (name, other) and \
                        "destroy" not in (name, other):
                    continue  # polling for errors beside an enqueue is what it is for
                what = ("ncclCommAbort frees what that call is using: a use after free" if name == "abort" else
                        "NCCL calls on one communicator must not overlap")
                _cuda._violation(f"{name}() while another thread is inside {other}() ({what})")
            self._inside[me] = name
        try:
            yield
        finally:
            with self._guard:
                self._inside.pop(me, None)

    # -- enqueueing ---------------------------------------------------------------------------

    def _enqueue(self, seq: Optional[int], spec) -> None:
        with self._guard:
            self._queued += 1
        _cuda._device.put(lambda: self._execute(seq, spec))

    def _collective(self, name: str, spec) -> None:
        with self._call(name):
            self._collectives += 1
            if getattr(_group, "depth", 0):
                _group.ops.append((self, spec))
            else:
                self._enqueue(self._collectives, spec)
            if _cuda._config["enqueue_s"]:
                time.sleep(float(_cuda._config["enqueue_s"]))

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802,N803 - cupy's names
        self._collective("allReduce", ("all_reduce", sendbuf, recvbuf, count, datatype, op))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):  # noqa: N803
        self._collective("reduce", ("reduce", sendbuf, recvbuf, count, datatype, op, root))

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):  # noqa: N803
        self._collective("broadcast", ("broadcast", sendbuf, recvbuf, count, datatype, root))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802,N803
        self._collective("allGather", ("all_gather", sendbuf, recvbuf, count, datatype))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802,N803
        self._collective("reduceScatter", ("reduce_scatter", sendbuf, recvbuf, recvcount, datatype, op))

    def _p2p(self, name: str, spec) -> None:
        with self._call(name):
            counters = self._sent if spec[0] == "send" else self._received
            peer = spec[3]
            counters[peer] = counters.get(peer, 0) + 1
            spec = spec + (counters[peer],)
            if getattr(_group, "depth", 0):
                _group.ops.append((self, spec))
            else:
                self._enqueue(None, ("group", [spec]))

    def send(self, sendbuf, count, datatype, peer, stream):  # noqa: N803
        self._p2p("send", ("send", sendbuf, count, int(peer), datatype))

    def recv(self, recvbuf, count, datatype, peer, stream):  # noqa: N803
        self._p2p("recv", ("recv", recvbuf, count, int(peer), datatype))

    # -- errors, teardown ---------------------------------------------------------------------

    def check_async_error(self) -> None:
        with self._call("check_async_error"):
            if self._async:
                raise NcclError(self._async)

    def abort(self) -> None:
        with self._guard:
            if self._state != "live":
                return  # cupy: _comm is already null
        with self._call("abort"):
            with self._guard:
                self._state = "abort"
            self._aborted.set()
            if self.dir:
                self._post(f"aborted.{self.me}", b"")

    def destroy(self) -> None:
        with self._guard:
            if self._state != "live":
                return
        with self._call("destroy"):
            with self._guard:  # ncclCommDestroy finalizes first: the communicator's work finishes
                if not self._guard.wait_for(lambda: self._queued == 0, timeout=600):
                    _cuda._violation("destroy() waited 600s for the communicator's work")
                self._state = "destroy"

    def rank_id(self) -> int:
        return self.me

    def size(self) -> int:
        return self.world

    # -- the device side ----------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(str(self.dir), name)

    def _post(self, name: str, payload: bytes) -> None:
        tmp = self._path(f".{name}.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(payload)
        os.replace(tmp, self._path(name))

    def _gather(self, name: str, ranks) -> Optional[Dict[int, bytes]]:
        """Every rank's ``name`` file, once all exist; None if this communicator was aborted."""
        got: Dict[int, bytes] = {}
        while True:
            for rank in ranks:
                if rank not in got and os.path.exists(self._path(f"{name}.{rank}")):
                    with open(self._path(f"{name}.{rank}"), "rb") as f:
                        got[rank] = f.read()
            if len(got) == len(ranks):
                return got
            if self._aborted.wait(_cuda._POLL_S):
                return None
            if self._async is None:
                gone = [r for r in range(self.world) if os.path.exists(self._path(f"aborted.{r}"))]
                if gone:
                    self._async = f"ncclRemoteError: rank {gone[0]} aborted its communicator"

    def _exchange(self, seq: int, mine: Optional[np.ndarray], ranks, dtype) -> Optional[Dict[int, np.ndarray]]:
        if self.dir is None:
            assert mine is not None, "one process: its own buffer is the only one"
            return {0: mine}
        if mine is not None:
            self._post(f"c{seq}.{self.me}", mine.tobytes())
        got = self._gather(f"c{seq}", ranks)
        return None if got is None else {r: np.frombuffer(b, dtype) for r, b in got.items()}

    def _execute(self, seq: Optional[int], spec) -> None:
        try:
            delay = _cuda._config["delays"].get(seq) if seq is not None else None
            if self._aborted.is_set() or (delay and self._aborted.wait(delay)):
                return  # discarded: an aborted communicator's kernels write nothing
            if spec[0] == "group":
                self._run_group(spec[1])
            else:
                self._run_collective(int(seq or 0), spec)
        finally:
            with self._guard:
                self._queued -= 1
                self._guard.notify_all()

    def _buffer(self, ptr: int, count: int, dtype) -> Optional[np.ndarray]:
        memory = _cuda._memory(ptr, count * np.dtype(dtype).itemsize)
        return None if memory is None else memory.view(dtype)

    def _run_collective(self, seq: int, spec) -> None:
        kind, send, recv, count, datatype = spec[:5]
        dtype = _DTYPES[datatype]
        everyone = range(self.world)
        if kind == "broadcast":
            root = spec[5]
            mine = self._buffer(send, count, dtype) if self.me == root else None
            got = self._exchange(seq, None if mine is None else mine.copy(), [root], dtype)
            out = self._buffer(recv, count, dtype)
            if got is not None and got[root].size != count:
                self._hang_on_a_count_mismatch()
                return
            if got is not None and out is not None:
                out[...] = got[root]
            return
        mine = self._buffer(send, count, dtype)
        if mine is None:
            return
        got = self._exchange(seq, mine.copy(), list(everyone), dtype)
        if got is None:
            return
        parts = [got[r] for r in everyone]
        if len({part.size for part in parts}) > 1:
            self._hang_on_a_count_mismatch()
            return
        if kind == "all_reduce":
            result = _reduce(spec[5], parts)
        elif kind == "reduce":
            if self.me != spec[6]:
                return
            result = _reduce(spec[5], parts)
        elif kind == "all_gather":
            result = np.concatenate(parts)
        else:  # reduce_scatter: this rank's chunk of the reduction
            result = _reduce(spec[5], [p[self.me * count:(self.me + 1) * count] for p in parts])
        out = self._buffer(recv, result.size, dtype)
        if out is not None:
            out[...] = result

    def _hang_on_a_count_mismatch(self) -> None:
        """Ranks that gave one collective different counts: NCCL does not check them, and its
        ranks wait for data that never comes; so does the fake, until the communicator is
        aborted (the watchdog's timeout does it)."""
        self._aborted.wait()

    def _run_group(self, ops) -> None:
        for kind, ptr, count, peer, datatype, n in ops:
            if kind == "send":
                data = self._buffer(ptr, count, _DTYPES[datatype])
                if data is not None:
                    self._post(f"p{self.me}-{peer}-{n}.{self.me}", data.tobytes())
        for kind, ptr, count, peer, datatype, n in ops:
            if kind == "recv":
                got = self._gather(f"p{peer}-{self.me}-{n}", [peer])
                out = self._buffer(ptr, count, _DTYPES[datatype])
                if got is not None and out is not None:
                    out[...] = np.frombuffer(got[peer], _DTYPES[datatype])
