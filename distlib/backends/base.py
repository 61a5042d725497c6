"""What a process group asks of a backend: two kinds, declared here, each method's contract.

The public API (collectives.py) validates arguments, maps global ranks to group ranks, orders
operations and then calls one method of the group's backend for the array's device. Arrays
arrive validated (contiguous, supported dtype, sizes consistent on this rank); ranks are
group-local. A backend is one of two kinds, and collectives.py dispatches on ``kind``:

* **Host-synchronous** (``CommBackend``: gloo, mpi, plugins): each method returns when this
  rank's part is done, the data in place. collectives.py runs it in the group's order (inline
  for a sync call, on the group's executor for ``async_op=True``, which makes the Work).
* **Stream-ordered** (``StreamOrderedBackend``: nccl): each method enqueues the operation on a
  device stream, after the caller's current stream, and returns its ``Work`` at once; the
  data is in place once the device has run it. A sync call makes the caller's stream wait
  (``Work.wait()``), not the host, as torch's ProcessGroupNCCL.

Both kinds: every blocking wait has the group timeout as its deadline and then raises
DistBackendError naming whom it waited for; ``shutdown()`` (destroy_process_group) keeps the
results of operations already issued, and ``abort()`` (torch's ``Backend.abort()``) does not.
Third-party backends subclass one kind and register with ``Backend.register_backend``; what
they do not implement raises NotImplementedError naming the operation.
"""

from __future__ import annotations

import abc
import enum
from datetime import timedelta
from typing import Any, ClassVar, Final, List, Literal, Optional, Sequence, Tuple, Union, cast

import numpy as np

from ..errors import DistBackendError
from ..reduce_op import ReduceOp
from ..work import Work


class BackendKind(enum.Enum):
    """How a backend's methods return (see the module docstring)."""

    HOST_SYNCHRONOUS = "host-synchronous"
    STREAM_ORDERED = "stream-ordered"


HOST_SYNCHRONOUS: Final = BackendKind.HOST_SYNCHRONOUS
STREAM_ORDERED: Final = BackendKind.STREAM_ORDERED


def refused_after_failure(label: str, rank: int, first: BaseException) -> DistBackendError:
    """The error of every operation on a group that failed earlier (a mismatch, a timeout, an
    abort): a group stays failed until it is destroyed, and each refusal names the first failure."""
    return DistBackendError(
        f"{label}: rank {rank}: this process group was aborted by an earlier failure, and every operation on it "
        f"fails until it is destroyed (destroy_process_group(group), then a new group): {first}")


class RecvHandle(abc.ABC):
    """A posted receive (irecv): ``wait()`` returns the sender's group rank."""

    @abc.abstractmethod
    def wait(self) -> int:
        """Block until the data is in the array.

        Returns:
            The sender's group rank.

        Raises:
            DistBackendError: the receive failed or ran past the group timeout.
        """

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the data has arrived (or the receive failed)."""


class HostObjectArrays:
    """Where object collectives put their pickled bytes: numpy arrays (put and get are the
    identity). A stream-ordered backend without a CPU side supplies device arrays instead."""

    @staticmethod
    def put(host: np.ndarray) -> Any:
        return host

    @staticmethod
    def get(array: Any) -> np.ndarray:
        return array


class BackendBase(abc.ABC):
    """What both kinds share: identity, the arrays of object collectives, and teardown."""

    #: Which kind of backend this is; collectives.py dispatches on it.
    kind: ClassVar[BackendKind]
    name = "custom"

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        """Args:
            store: the group's store (a PrefixStore of the default store), or None (mpi).
            rank: this process's rank in the group.
            size: the number of ranks in the group.
            timeout: the deadline of every blocking wait of the group.
        """
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = timeout

    def _unsupported(self, op: str) -> NotImplementedError:
        return NotImplementedError(f"backend {self.name!r} does not implement {op}")

    def for_array(self, array) -> AnyBackend:
        """What runs one operation, issued now, on ``array``.

        Args:
            array: the operation's first array (its device decides).

        Returns:
            The backend itself, or a wrapper for that one operation (gloo and mpi stage cupy
            arrays through host memory, see cuda_staging.py).
        """
        # every backend is one of the two kinds (the registry refuses anything else)
        return cast(AnyBackend, self)

    def object_arrays(self) -> Any:
        """Where object collectives (broadcast_object_list, ...) keep their pickled bytes.

        Returns:
            An object with ``put(numpy array) -> array`` and ``get(array) -> numpy array``:
            HostObjectArrays here; a GPU-only backend returns arrays on its device, as torch
            does for an NCCL-only group.
        """
        return HostObjectArrays

    def shutdown(self) -> None:  # noqa: B027 - optional: a backend holding nothing inherits the no-op
        """Release sockets, threads, shared memory and communicators (destroy_process_group).

        Operations already issued keep their results: a backend whose operations can still be
        running (stream-ordered) waits for them first, within the group timeout, and aborts
        only when that runs out or the group has already failed (torch >= 2.6).

        Raises:
            Nothing: a teardown that cannot release something logs it and goes on.
        """

    def abort(self, reason: Optional[str] = None) -> None:
        """Fail every pending operation now and release what shutdown() releases, without
        waiting for anything (torch's ``Backend.abort()``, ``_abort_process_group``).

        Args:
            reason: what the pending operations' error says; None: "the process group was
                aborted".
        """
        self.shutdown()


class CommBackend(BackendBase):
    """The host-synchronous kind: each method returns when this rank's part is done.

    Every method below:

    Returns:
        None (the data is in the arrays), unless it says otherwise.

    Raises:
        DistBackendError: another rank failed, disagreed on the operation, or did not take
            part within the group timeout (the text names which rank and what was waited for).
        NotImplementedError: the backend does not implement the operation (the default).
    """

    kind: ClassVar[Literal[BackendKind.HOST_SYNCHRONOUS]] = HOST_SYNCHRONOUS

    def broadcast(self, array: np.ndarray, root: int) -> None:
        """Args: ``array`` (the root's data; written on the others), ``root`` (group rank)."""
        raise self._unsupported("broadcast")

    def all_reduce(self, array: np.ndarray, op: ReduceOp) -> None:
        """Args: ``array`` (input, and the result on every rank), ``op``."""
        raise self._unsupported("all_reduce")

    def reduce(self, array: np.ndarray, root: int, op: ReduceOp) -> None:
        """Args: ``array`` (input; the result on ``root`` only), ``root``, ``op``."""
        raise self._unsupported("reduce")

    def all_gather(self, outputs: Sequence[np.ndarray], array: np.ndarray) -> None:
        """Args: ``outputs`` (one per rank, each the size of ``array``), ``array``."""
        raise self._unsupported("all_gather")

    def all_gather_into(self, output: np.ndarray, array: np.ndarray) -> None:
        """Args: ``output`` (size x array.size, rank order), ``array``."""
        raise self._unsupported("all_gather_into_tensor")

    def gather(self, outputs: Optional[Sequence[np.ndarray]], array: np.ndarray, root: int) -> None:
        """Args: ``outputs`` (on ``root``: one per rank; elsewhere None), ``array``, ``root``."""
        raise self._unsupported("gather")

    def scatter(self, output: np.ndarray, inputs: Optional[Sequence[np.ndarray]], root: int) -> None:
        """Args: ``output``, ``inputs`` (on ``root``: one per rank; elsewhere None), ``root``."""
        raise self._unsupported("scatter")

    def reduce_scatter(self, output: np.ndarray, inputs: Sequence[np.ndarray], op: ReduceOp) -> None:
        """Args: ``output`` (gets the reduction of every rank's ``inputs[rank]``), ``inputs``, ``op``."""
        raise self._unsupported("reduce_scatter")

    def reduce_scatter_into(self, output: np.ndarray, array: np.ndarray, op: ReduceOp) -> None:
        """Args: ``output`` (chunk ``rank`` of the reduced ``array``), ``array`` (size x output), ``op``."""
        raise self._unsupported("reduce_scatter_tensor")

    def all_to_all(self, outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> None:
        """Args: ``outputs`` (``outputs[r]`` from rank r), ``inputs`` (``inputs[r]`` to rank r)."""
        raise self._unsupported("all_to_all")

    def all_to_all_single(self, output: np.ndarray, array: np.ndarray,
                          output_splits: List[int], input_splits: List[int]) -> None:
        """Args: ``output``, ``array``, and the rows (dim 0) received from / sent to each rank."""
        raise self._unsupported("all_to_all_single")

    def barrier(self) -> None:
        """Return once every rank of the group has entered the barrier."""
        raise self._unsupported("barrier")

    def monitored_barrier(self, timeout: timedelta, wait_all_ranks: bool) -> None:
        """Rank 0 waits for every rank's arrival within ``timeout``.

        Args:
            timeout: the barrier's own deadline.
            wait_all_ranks: name every missing rank (True) or the first (False).

        Raises:
            DistBackendError: on rank 0, naming the rank(s) that did not arrive in time.
        """
        raise self._unsupported("monitored_barrier")

    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        """Args: ``array``, ``dst`` (group rank), ``tag`` (matched with the receive's)."""
        raise self._unsupported("send")

    def post_recv(self, array: np.ndarray, src: Optional[int], tag: int) -> RecvHandle:
        """Start a receive into ``array`` from ``src`` (None: any rank) with ``tag``.

        Returns:
            Its handle; ``wait()`` returns the sender's group rank.
        """
        raise self._unsupported("recv")

    def post_send(self, array: np.ndarray, dst: int, tag: int) -> Optional[RecvHandle]:
        """Start a send now, for a backend whose sends progress without the group's executor
        (MPI_Isend).

        Returns:
            Its handle (``wait()`` returns ``dst``), or None (the default): isend then runs
            ``send`` in the group's order.
        """
        return None


class StreamOrderedBackend(BackendBase):
    """The stream-ordered kind: each method enqueues on a device stream and returns at once.

    Every collective and point-to-point method below is ordered after the caller's current
    stream at the time of the call, keeps its arrays alive until the device has run it, and:

    Returns:
        Work: ``wait()`` makes the caller's current stream wait for the operation (``wait(
        timeout)`` and ``synchronize()`` block the host), ``is_completed()`` asks the device,
        ``exception()`` holds a failure; the watchdog settles it, in issue order.

    Raises:
        ValueError, TypeError: refused before anything is enqueued (an op or dtype the
            device library lacks, an array on another device); the group stays usable.
        DistBackendError: the group has failed (a timeout, a peer's error, an abort, a
            destroy): the text is the failure's, the same for every later call.
    """

    kind: ClassVar[Literal[BackendKind.STREAM_ORDERED]] = STREAM_ORDERED

    def broadcast(self, array, root: int) -> Work:
        """Args: ``array`` (the root's data; written on the others), ``root`` (group rank)."""
        raise self._unsupported("broadcast")

    def all_reduce(self, array, op: ReduceOp) -> Work:
        """Args: ``array`` (input, and the result on every rank), ``op``."""
        raise self._unsupported("all_reduce")

    def reduce(self, array, root: int, op: ReduceOp) -> Work:
        """Args: ``array`` (input; the result on ``root`` only), ``root``, ``op``."""
        raise self._unsupported("reduce")

    def all_gather(self, outputs: Sequence, array) -> Work:
        """Args: ``outputs`` (one per rank, each the size of ``array``), ``array``."""
        raise self._unsupported("all_gather")

    def all_gather_into(self, output, array) -> Work:
        """Args: ``output`` (size x array.size, rank order), ``array``."""
        raise self._unsupported("all_gather_into_tensor")

    def gather(self, outputs: Optional[Sequence], array, root: int) -> Work:
        """Args: ``outputs`` (on ``root``: one per rank; elsewhere None), ``array``, ``root``."""
        raise self._unsupported("gather")

    def scatter(self, output, inputs: Optional[Sequence], root: int) -> Work:
        """Args: ``output``, ``inputs`` (on ``root``: one per rank; elsewhere None), ``root``."""
        raise self._unsupported("scatter")

    def reduce_scatter(self, output, inputs: Sequence, op: ReduceOp) -> Work:
        """Args: ``output`` (gets the reduction of every rank's ``inputs[rank]``), ``inputs``, ``op``."""
        raise self._unsupported("reduce_scatter")

    def reduce_scatter_into(self, output, array, op: ReduceOp) -> Work:
        """Args: ``output`` (chunk ``rank`` of the reduced ``array``), ``array`` (size x output), ``op``."""
        raise self._unsupported("reduce_scatter_tensor")

    def all_to_all(self, outputs: Sequence, inputs: Sequence) -> Work:
        """Args: ``outputs`` (``outputs[r]`` from rank r), ``inputs`` (``inputs[r]`` to rank r)."""
        raise self._unsupported("all_to_all")

    def all_to_all_single(self, output, array, output_splits: List[int], input_splits: List[int]) -> Work:
        """Args: ``output``, ``array``, and the rows (dim 0) received from / sent to each rank."""
        raise self._unsupported("all_to_all_single")

    def barrier(self, device_ids: Optional[Sequence[int]] = None) -> Work:
        """A collective on no user data; its Work's ``wait()`` blocks the host, as torch's.

        Args:
            device_ids: ``[N]``: the device to use if the group has none yet (torch's
                ``barrier(device_ids=...)``); None: the group's device.
        """
        raise self._unsupported("barrier")

    def send(self, array, dst: int, tag: int) -> Work:
        """Args: ``array``, ``dst`` (group rank), ``tag`` (a backend may ignore it, as NCCL does)."""
        raise self._unsupported("send")

    def post_recv(self, array, src: Optional[int], tag: int) -> RecvHandle:
        """Enqueue a receive into ``array`` from ``src``.

        Returns:
            Its handle; ``wait()`` makes the current stream wait and returns ``src``.

        Raises:
            ValueError: ``src`` is None and the backend has no wildcard receive.
        """
        raise self._unsupported("recv")

    def batch_p2p(self, items: Sequence[Tuple[bool, Any, int]]) -> Work:
        """Every send and receive of one batch_isend_irecv as one device-side group.

        Args:
            items: ``(is_send, array, group peer)`` per operation, in the user's order.

        Returns:
            One Work for the whole batch (torch returns one coalesced Work too).
        """
        raise self._unsupported("batch_isend_irecv")

    def stream_waits_for(self, event) -> None:
        """Make the caller's current stream (on the group's device) wait for ``event``.

        Args:
            event: a device event recorded by this backend (a Work's completion).
        """
        raise self._unsupported("stream_waits_for")


#: A backend of either kind: what a group holds and what collectives.py dispatches on ``kind``.
AnyBackend = Union[CommBackend, StreamOrderedBackend]
