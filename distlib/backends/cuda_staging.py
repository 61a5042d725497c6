"""cupy arrays on a CPU backend: copy to host, run the collective there, copy back.

What torch's gloo does with CUDA tensors, and what lets several ranks share one GPU in tests
(NCCL refuses that). ``HostStaged`` wraps the backend for one operation: the arrays the
operation reads are copied to host memory, the wrapped backend runs on the host copies, and
the arrays it writes are copied back. The copies are ordered after the caller's stream as it
was when the operation was issued (an event recorded then, waited for by a side stream), and
the caller's stream waits for the copies back, so work the caller enqueues afterwards sees
the result, without a host synchronisation on the caller's side.

The copying is a small protocol (``to_host``, ``empty_host``, ``to_device``, ``finished``):
``CupyCopies`` implements it for cupy; any array type with host copies can use the same
path (the tests drive it on CPU with numpy copies).
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .base import CommBackend, RecvHandle

_side_streams: Dict[int, object] = {}
_side_lock = threading.Lock()


def _side_stream(cupy, device: int):
    """One non-blocking stream per device for the copies (a stream costs a driver call)."""
    with _side_lock:
        stream = _side_streams.get(device)
        if stream is None:
            with cupy.cuda.Device(device):
                stream = _side_streams[device] = cupy.cuda.Stream(non_blocking=True)
        return stream


class CupyCopies:
    """The copies of one operation on cupy arrays of one device; made when it is issued."""

    def __init__(self, array):
        from . import cupy_env

        # cupy as the process has it (cupy_env.install's seam: the fake device on CPU hosts)
        cupy = self.cupy = cupy_env.status().cupy
        self.device = int(array.device.id)
        self.side = _side_stream(cupy, self.device)
        with cupy.cuda.Device(self.device):
            self.caller = cupy.cuda.get_current_stream()
            # Enqueued now, in issue order: every copy of this operation, down or back, comes
            # after what the caller had enqueued before the call.
            self.side.wait_event(self.caller.record())

    def to_host(self, array) -> np.ndarray:
        with self.cupy.cuda.Device(self.device):
            return array.get(stream=self.side)  # blocking: the host copy is complete on return

    @staticmethod
    def empty_host(array) -> np.ndarray:
        return np.empty(array.shape, dtype=array.dtype)

    def to_device(self, host: np.ndarray, array) -> None:
        with self.cupy.cuda.Device(self.device):
            array.set(host, stream=self.side)

    def finished(self) -> None:
        with self.cupy.cuda.Device(self.device):
            self.caller.wait_event(self.side.record())


class _StagedRecv(RecvHandle):
    def __init__(self, handle: RecvHandle, copies, host: np.ndarray, array):
        self.handle, self.copies, self.host, self.array = handle, copies, host, array

    def wait(self) -> int:
        source = self.handle.wait()
        self.copies.to_device(self.host, self.array)
        self.copies.finished()
        return source

    def is_completed(self) -> bool:
        return self.handle.is_completed()


class HostStaged(CommBackend):
    """``inner`` run on host copies of one operation's arrays."""

    def __init__(self, inner: CommBackend, copies):
        super().__init__(inner.store, inner.rank, inner.size, inner.timeout)
        self.inner, self.copies = inner, copies
        self.name = inner.name

    def _staged(self, reads: Sequence, writes: Sequence, run: Callable[[Callable], None]) -> None:
        """``run(host)``, where ``host(array)`` is the host copy of an array of ``reads`` (its
        data) or ``writes`` (filled by run); the ``writes`` are copied back afterwards."""
        hosts = {}
        for array in reads:
            hosts[id(array)] = self.copies.to_host(array)
        for array in writes:
            if id(array) not in hosts:
                hosts[id(array)] = self.copies.empty_host(array)
        run(lambda array: hosts[id(array)])
        for array in writes:
            self.copies.to_device(hosts[id(array)], array)
        self.copies.finished()

    @staticmethod
    def _all(arrays: Optional[Sequence]) -> List:
        return list(arrays) if arrays else []

    def broadcast(self, array, root: int) -> None:
        mine = self.rank == root
        self._staged([array] if mine else [], [] if mine else [array],
                     lambda host: self.inner.broadcast(host(array), root))

    def all_reduce(self, array, op) -> None:
        self._staged([array], [array], lambda host: self.inner.all_reduce(host(array), op))

    def reduce(self, array, root: int, op) -> None:
        self._staged([array], [array] if self.rank == root else [],
                     lambda host: self.inner.reduce(host(array), root, op))

    def all_gather(self, outputs, array) -> None:
        self._staged([array], outputs, lambda host: self.inner.all_gather([host(o) for o in outputs], host(array)))

    def all_gather_into(self, output, array) -> None:
        self._staged([array], [output], lambda host: self.inner.all_gather_into(host(output), host(array)))

    def gather(self, outputs, array, root: int) -> None:
        outs = self._all(outputs)
        self._staged([array], outs,
                     lambda host: self.inner.gather([host(o) for o in outs] if outputs else outputs, host(array), root))

    def scatter(self, output, inputs, root: int) -> None:
        ins = self._all(inputs)
        self._staged(ins, [output],
                     lambda host: self.inner.scatter(host(output), [host(i) for i in ins] if inputs else inputs, root))

    def reduce_scatter(self, output, inputs, op) -> None:
        self._staged(inputs, [output],
                     lambda host: self.inner.reduce_scatter(host(output), [host(i) for i in inputs], op))

    def reduce_scatter_into(self, output, array, op) -> None:
        self._staged([array], [output], lambda host: self.inner.reduce_scatter_into(host(output), host(array), op))

    def all_to_all(self, outputs, inputs) -> None:
        self._staged(inputs, outputs,
                     lambda host: self.inner.all_to_all([host(o) for o in outputs], [host(i) for i in inputs]))

    def all_to_all_single(self, output, array, output_splits, input_splits) -> None:
        self._staged([array], [output], lambda host: self.inner.all_to_all_single(
            host(output), host(array), output_splits, input_splits))

    def barrier(self) -> None:
        self.inner.barrier()

    def monitored_barrier(self, timeout, wait_all_ranks: bool) -> None:
        self.inner.monitored_barrier(timeout, wait_all_ranks)

    def send(self, array, dst: int, tag: int) -> None:
        self._staged([array], [], lambda host: self.inner.send(host(array), dst, tag))

    def post_recv(self, array, src: Optional[int], tag: int) -> RecvHandle:
        host = self.copies.empty_host(array)
        return _StagedRecv(self.inner.post_recv(host, src, tag), self.copies, host, array)

    def shutdown(self) -> None:
        """Nothing: the wrapper lives for one operation; the group shuts its backend down."""

    def abort(self, reason: Optional[str] = None) -> None:
        """Nothing, as shutdown."""


def staged(backend: CommBackend, array) -> HostStaged:
    """``backend`` for one operation on cupy ``array`` (and the others of that operation)."""
    return HostStaged(backend, CupyCopies(array))
