"""``CommBackend``: what a process group asks of a backend, for one device type.

The public API (distributed.py) validates arguments, maps global ranks to group ranks, and
orders operations; a backend only moves and reduces data. Every method is synchronous (it
returns when this rank's part is done) and has a deadline of the group timeout, after which
it raises DistBackendError naming whom it waited for. Arrays arrive validated (contiguous,
supported dtype, sizes consistent on this rank); ranks are group-local.

Third-party backends subclass this and register with ``Backend.register_backend``; they
implement what they support, and the rest raise NotImplementedError with the op's name.
"""

from __future__ import annotations

import abc
from datetime import timedelta
from typing import List, Optional, Sequence

import numpy as np

from ..reduce_op import ReduceOp


class RecvHandle(abc.ABC):
    """A posted receive (irecv): ``wait()`` returns the sender's group rank."""

    @abc.abstractmethod
    def wait(self) -> int:
        """Block until the data is in the array; return the sender's group rank."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the data has arrived (or the receive failed)."""


class CommBackend(abc.ABC):
    """Collectives for one device type within one process group."""

    name = "custom"
    #: False: each method returns when this rank's part is done. True (nccl): each method
    #: enqueues on a device stream and returns the operation's Work at once.
    stream_ordered = False

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = timeout

    def for_array(self, array) -> "CommBackend":
        """What runs one operation, issued now, on ``array``: the backend itself, unless it
        stages device arrays through host memory (gloo with cupy arrays)."""
        return self

    def _unsupported(self, op: str):
        return NotImplementedError(f"backend {self.name!r} does not implement {op}")

    # Each default raises; backends override what they support.

    def broadcast(self, array: np.ndarray, root: int) -> None:
        raise self._unsupported("broadcast")

    def all_reduce(self, array: np.ndarray, op: ReduceOp) -> None:
        raise self._unsupported("all_reduce")

    def reduce(self, array: np.ndarray, root: int, op: ReduceOp) -> None:
        raise self._unsupported("reduce")

    def all_gather(self, outputs: Sequence[np.ndarray], array: np.ndarray) -> None:
        raise self._unsupported("all_gather")

    def all_gather_into(self, output: np.ndarray, array: np.ndarray) -> None:
        raise self._unsupported("all_gather_into_tensor")

    def gather(self, outputs: Optional[Sequence[np.ndarray]], array: np.ndarray, root: int) -> None:
        raise self._unsupported("gather")

    def scatter(self, output: np.ndarray, inputs: Optional[Sequence[np.ndarray]], root: int) -> None:
        raise self._unsupported("scatter")

    def reduce_scatter(self, output: np.ndarray, inputs: Sequence[np.ndarray], op: ReduceOp) -> None:
        raise self._unsupported("reduce_scatter")

    def reduce_scatter_into(self, output: np.ndarray, array: np.ndarray, op: ReduceOp) -> None:
        raise self._unsupported("reduce_scatter_tensor")

    def all_to_all(self, outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> None:
        raise self._unsupported("all_to_all")

    def all_to_all_single(self, output: np.ndarray, array: np.ndarray,
                          output_splits: List[int], input_splits: List[int]) -> None:
        raise self._unsupported("all_to_all_single")

    def barrier(self) -> None:
        raise self._unsupported("barrier")

    def monitored_barrier(self, timeout: timedelta, wait_all_ranks: bool) -> None:
        raise self._unsupported("monitored_barrier")

    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        raise self._unsupported("send")

    def post_recv(self, array: np.ndarray, src: Optional[int], tag: int) -> RecvHandle:
        raise self._unsupported("recv")

    def post_send(self, array: np.ndarray, dst: int, tag: int) -> Optional[RecvHandle]:
        """Start a send now and return its handle (``wait()`` returns ``dst``), for a backend
        whose sends progress without the group's executor (MPI_Isend); None (the default):
        isend runs ``send`` in the group's order."""
        return None

    def shutdown(self) -> None:
        """Release sockets, threads and shared memory (destroy_process_group)."""

    def abort(self, reason: str) -> None:
        """Fail every pending operation of this backend with ``reason`` (default: shutdown)."""
        self.shutdown()
