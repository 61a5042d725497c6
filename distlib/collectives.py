"""The collectives and point-to-point operations on arrays, with torch.distributed's signatures.

Each function checks its arguments before anything is sent (contiguity, dtype, list lengths,
ranks in range, sizes that must agree on this rank, reduce op vs dtype), maps global ranks to
group ranks, and runs the backend's operation in the group's order. ``async_op=True`` returns
a ``Work``. The array's device picks the backend (a "cpu:gloo,cuda:nccl" group sends numpy
arrays to gloo and cupy arrays to nccl). Each call goes by its backend's declared kind
(backends/base.py): a host-synchronous backend runs in the group's order; a stream-ordered
one (nccl) enqueues at once, in the caller's thread, and a synchronous call leaves the
caller's stream waiting for it. In
place where torch works in place. A rank outside ``group`` gets a warning and None, as in
torch. What cannot be checked locally (another rank passing a different shape,
dtype or collective) is detected from the frames and raised on every rank.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from . import observers
from .arrays import check_array, check_array_list, check_one_device, same_dtype
from .backends.base import STREAM_ORDERED, AnyBackend, RecvHandle
from .distributed import _resolve, warn_not_in_group
from .errors import DistBackendError
from .group import ProcessGroup
from .reduce_op import ReduceOp, as_reduce_op, check_op_for_dtype
from .work import Future, HostWork, Work


def _run(pg: ProcessGroup, backend: AnyBackend, op_name: str, async_op: bool, result: Optional[List[Any]],
         fn: Callable[..., Any], *args: Any) -> Optional[Work]:
    """``fn(*args)`` (one of ``backend``'s methods), by the backend's declared kind.

    Host-synchronous: in the group's order, inline for a sync call (no Work, no closure), a
    queued Work for an async one. Stream-ordered: ``fn`` enqueues on the device stream and
    returns the operation's Work at once; a sync call then makes the caller's stream wait,
    not the host (torch's semantics)."""
    if observers.collective_entered is not None:
        observers.collective_entered(op_name)
    if backend.kind is STREAM_ORDERED:
        work = fn(*args)
        if async_op:
            return work
        work.wait()
        return None
    if async_op:
        work = HostWork(op_name, result)
        return pg.executor.submit(work, lambda: fn(*args) or result)
    pg.executor.run(op_name, fn, *args)
    return None


def _peer(pg: ProcessGroup, rank: Optional[int], group_rank: Optional[int], what: str, required: bool = True):
    """Group rank from a global ``rank`` or a ``group_rank`` (only one may be given)."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"Can only specify one of {what} or group_{what}")
    if group_rank is not None:
        if not 0 <= group_rank < pg.size():
            raise ValueError(f"group_{what}={group_rank} is out of range for a group of {pg.size()} ranks")
        return group_rank
    if rank is None:
        if required:
            raise ValueError(f"{what} must be given (a global rank), or group_{what}")
        return None
    if not isinstance(rank, (int, np.integer)):
        raise TypeError(f"{what} must be an int rank, got {type(rank).__name__}")
    return pg.group_rank_of(int(rank))


def _backend(pg: ProcessGroup, array, *others) -> AnyBackend:
    """The backend for the device of the operation's arrays (all on one kind), wrapped to stage
    device arrays through host memory where it does (gloo and mpi with cupy arrays)."""
    if type(array) is np.ndarray and not others:  # the common case: no device lookup, no staging
        backend = pg.backends.get("cpu")
        if backend is not None:
            return backend
    return pg.backend_for(check_one_device(array, *others)).for_array(array)


#: (reduce op, dtype) pairs already checked: the check's dtype introspection costs about as
#: much as a whole small all_reduce through shared memory.
_VALID_OPS: set = set()


def _check_op(op: ReduceOp, dtype: np.dtype, what: str) -> None:
    key = (op.op, dtype)
    if key not in _VALID_OPS:
        check_op_for_dtype(op, dtype, what)
        _VALID_OPS.add(key)


# -- collectives ----------------------------------------------------------------------------------


def broadcast(tensor, src: Optional[int] = None, group=None, async_op: bool = False,
              group_src: Optional[int] = None):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("broadcast")
    root = _peer(pg, src, group_src, "src")
    array = check_array(tensor, "tensor", writable=pg.rank() != root)
    backend = _backend(pg, array)
    return _run(pg, backend, "broadcast", async_op, [array], backend.broadcast, array, root)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("all_reduce")
    array = check_array(tensor, "tensor", writable=True)
    op = as_reduce_op(op)
    _check_op(op, array.dtype, "tensor")
    backend = _backend(pg, array)
    return _run(pg, backend, "all_reduce", async_op, [array], backend.all_reduce, array, op)


def reduce(tensor, dst: Optional[int] = None, op=ReduceOp.SUM, group=None, async_op: bool = False,
           group_dst: Optional[int] = None):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("reduce")
    root = _peer(pg, dst, group_dst, "dst")
    array = check_array(tensor, "tensor", writable=pg.rank() == root)
    op = as_reduce_op(op)
    _check_op(op, array.dtype, "tensor")
    backend = _backend(pg, array)
    return _run(pg, backend, "reduce", async_op, [array], backend.reduce, array, root, op)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("all_gather")
    array = check_array(tensor, "tensor")
    outputs = check_array_list(tensor_list, "tensor_list", pg.size(), writable=True)
    same_dtype(outputs, array, "tensor_list", "tensor")
    for i, out in enumerate(outputs):
        if out.size != array.size:
            raise ValueError(f"tensor_list[{i}] has {out.size} elements but tensor has {array.size}: "
                             f"each output must be the size of the input")
    backend = _backend(pg, array, outputs)
    return _run(pg, backend, "all_gather", async_op, list(outputs), backend.all_gather, outputs, array)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("all_gather_into_tensor")
    array = check_array(input_tensor, "input_tensor")
    output = check_array(output_tensor, "output_tensor", writable=True)
    if output.dtype != array.dtype:
        raise TypeError(f"output_tensor has dtype {output.dtype} but input_tensor has {array.dtype}")
    if output.size != array.size * pg.size():
        raise ValueError(f"output_tensor has {output.size} elements; it must have world_size x input "
                         f"= {pg.size()} x {array.size} = {pg.size() * array.size}")
    backend = _backend(pg, array, output)
    return _run(pg, backend, "all_gather_into_tensor", async_op, [output], backend.all_gather_into, output,
                array)


def gather(tensor, gather_list=None, dst: Optional[int] = None, group=None, async_op: bool = False,
           group_dst: Optional[int] = None):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("gather")
    root = _peer(pg, dst, group_dst, "dst", required=False)
    root = 0 if root is None else root
    array = check_array(tensor, "tensor")
    if pg.rank() == root:
        if gather_list is None:
            raise ValueError("Argument ``gather_list`` must be specified on destination rank.")
        outputs = check_array_list(gather_list, "gather_list", pg.size(), writable=True)
        same_dtype(outputs, array, "gather_list", "tensor")
        for i, out in enumerate(outputs):
            if out.size != array.size:
                raise ValueError(f"gather_list[{i}] has {out.size} elements but tensor has {array.size}")
    else:
        if gather_list:
            raise ValueError("Argument ``gather_list`` must NOT be specified on non-destination ranks.")
        outputs = None
    backend = _backend(pg, array, outputs)
    return _run(pg, backend, "gather", async_op, list(outputs) if outputs else [], backend.gather, outputs, array,
                root)


def scatter(tensor, scatter_list=None, src: Optional[int] = None, group=None, async_op: bool = False,
            group_src: Optional[int] = None):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("scatter")
    root = _peer(pg, src, group_src, "src", required=False)
    root = 0 if root is None else root
    output = check_array(tensor, "tensor", writable=True)
    if pg.rank() == root:
        if scatter_list is None:
            raise ValueError("Argument ``scatter_list`` must be specified on source rank.")
        inputs = check_array_list(scatter_list, "scatter_list", pg.size())
        same_dtype(inputs, output, "scatter_list", "tensor")
        for i, item in enumerate(inputs):
            if item.size != output.size:
                raise ValueError(f"scatter_list[{i}] has {item.size} elements but tensor has {output.size}")
    else:
        if scatter_list:
            raise ValueError("Argument ``scatter_list`` must NOT be specified on non-source ranks.")
        inputs = None
    backend = _backend(pg, output, inputs)
    return _run(pg, backend, "scatter", async_op, [output], backend.scatter, output, inputs, root)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("reduce_scatter")
    out = check_array(output, "output", writable=True)
    inputs = check_array_list(input_list, "input_list", pg.size())
    same_dtype(inputs, out, "input_list", "output")
    for i, item in enumerate(inputs):
        if item.size != out.size:
            raise ValueError(f"input_list[{i}] has {item.size} elements but output has {out.size}")
    op = as_reduce_op(op)
    _check_op(op, out.dtype, "output")
    backend = _backend(pg, out, inputs)
    return _run(pg, backend, "reduce_scatter", async_op, [out], backend.reduce_scatter, out, inputs, op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op: bool = False):  # noqa: A002
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("reduce_scatter_tensor")
    out = check_array(output, "output", writable=True)
    array = check_array(input, "input")
    if out.dtype != array.dtype:
        raise TypeError(f"output has dtype {out.dtype} but input has {array.dtype}")
    if array.size != out.size * pg.size():
        raise ValueError(f"input has {array.size} elements; it must have world_size x output "
                         f"= {pg.size()} x {out.size} = {pg.size() * out.size}")
    op = as_reduce_op(op)
    _check_op(op, out.dtype, "output")
    backend = _backend(pg, out, array)
    return _run(pg, backend, "reduce_scatter_tensor", async_op, [out], backend.reduce_scatter_into, out, array,
                op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("all_to_all")
    inputs = check_array_list(input_tensor_list, "input_tensor_list", pg.size())
    outputs = check_array_list(output_tensor_list, "output_tensor_list", pg.size(), writable=True)
    same_dtype(outputs, inputs[0], "output_tensor_list", "input_tensor_list[0]")
    same_dtype(inputs, inputs[0], "input_tensor_list", "input_tensor_list[0]")
    me = pg.rank()
    if outputs[me].size != inputs[me].size:
        raise ValueError(f"output_tensor_list[{me}] ({outputs[me].size} elements) must match "
                         f"input_tensor_list[{me}] ({inputs[me].size}): this rank sends that one to itself")
    backend = _backend(pg, inputs[0], inputs, outputs)
    return _run(pg, backend, "all_to_all", async_op, list(outputs), backend.all_to_all, outputs, inputs)


def _splits(splits: Optional[Sequence[int]], rows: int, size: int, name: str) -> List[int]:
    if splits is None or len(splits) == 0:
        if rows % size:
            raise ValueError(f"{name} not given and dim 0 ({rows}) is not divisible by the group size ({size})")
        return [rows // size] * size
    splits = [int(s) for s in splits]
    if len(splits) != size:
        raise ValueError(f"{name} has {len(splits)} entries but the group has {size} ranks")
    if any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"{name} {splits} must be non-negative and sum to dim 0 ({rows})")
    return splits


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,  # noqa: A002
                      group=None, async_op: bool = False):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("all_to_all_single")
    out = check_array(output, "output", writable=True)
    array = check_array(input, "input")
    if out.dtype != array.dtype:
        raise TypeError(f"output has dtype {out.dtype} but input has {array.dtype}")
    if out.shape[1:] != array.shape[1:]:
        raise ValueError(f"output and input must agree beyond dim 0: {out.shape} vs {array.shape}")
    size = pg.size()
    rows_out = out.shape[0] if out.ndim else 1
    rows_in = array.shape[0] if array.ndim else 1
    out_splits = _splits(output_split_sizes, rows_out, size, "output_split_sizes")
    in_splits = _splits(input_split_sizes, rows_in, size, "input_split_sizes")
    me = pg.rank()
    if out_splits[me] != in_splits[me]:
        raise ValueError(f"output_split_sizes[{me}]={out_splits[me]} must equal input_split_sizes[{me}]="
                         f"{in_splits[me]}: this rank sends that block to itself")
    backend = _backend(pg, array, out)
    return _run(pg, backend, "all_to_all_single", async_op, [out], backend.all_to_all_single, out, array,
                out_splits, in_splits)


def barrier(group=None, async_op: bool = False, device_ids=None):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("barrier")
    backend = pg.backend_for("cpu") if "cpu" in pg.backends else next(iter(pg.backends.values()))
    if backend.kind is STREAM_ORDERED:  # nccl: an all_reduce on device_ids[0], else on the group's device
        return _run(pg, backend, "barrier", async_op, None, backend.barrier, device_ids)
    return _run(pg, backend, "barrier", async_op, None, backend.barrier)


def monitored_barrier(group=None, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False):
    """Rank 0 waits for every rank; on timeout it names the ranks that did not arrive."""
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("monitored_barrier")
    timeout = timeout if timeout is not None else pg.timeout
    backend = pg.backend_for("cpu")
    if backend.kind is STREAM_ORDERED:
        raise NotImplementedError(f"backend {backend.name!r} does not implement monitored_barrier: it is the "
                                  "host-synchronous kind's (gloo, mpi)")
    return _run(pg, backend, "monitored_barrier", False, None, backend.monitored_barrier, timeout, wait_all_ranks)


# -- point to point -------------------------------------------------------------------------------


def _p2p_args(tensor, tag: int, writable: bool):
    array = check_array(tensor, "tensor", writable=writable)
    if not isinstance(tag, (int, np.integer)) or not 0 <= int(tag) < 2**32:
        raise ValueError(f"tag must be an int in [0, 2**32), got {tag!r}")
    return array, int(tag)


def send(tensor, dst: Optional[int] = None, group=None, tag: int = 0, group_dst: Optional[int] = None) -> None:
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


def isend(tensor, dst: Optional[int] = None, group=None, tag: int = 0, group_dst: Optional[int] = None):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("isend")
    peer = _peer(pg, dst, group_dst, "dst")
    if peer == pg.rank():
        raise ValueError("Invalid destination rank: can't send to self")
    array, tag = _p2p_args(tensor, tag, writable=False)
    backend = _backend(pg, array)
    if backend.kind is STREAM_ORDERED:
        return backend.send(array, peer, tag)
    handle = backend.post_send(array, peer, tag)
    if handle is not None:
        return _RecvWork(pg, handle, array, "send")
    return _run(pg, backend, "send", True, [array], backend.send, array, peer, tag)


class _RecvWork(HostWork):
    """An irecv (or a backend's posted send): started when issued, complete when the data has
    arrived (left)."""

    def __init__(self, pg: ProcessGroup, handle: RecvHandle, array, op_name: str = "recv"):
        super().__init__(op_name, [array])
        self._pg, self._handle = pg, handle
        self.source: Optional[int] = None

    def wait(self, timeout=None) -> bool:
        if not self._future.done():
            try:
                group_rank = self._handle.wait()
                self.source = self._pg.global_rank_of(group_rank)
                self.finish()
            except BaseException as exc:  # noqa: BLE001 - kept on the Work
                self.finish(exc)
        return super().wait(timeout)

    def is_completed(self) -> bool:
        return self._future.done() or self._handle.is_completed()

    def is_success(self) -> bool:
        if self._handle.is_completed() and not self._future.done():
            self.wait()
        return super().is_success()

    def get_future(self) -> Future:
        if not self._future.done():
            import threading

            threading.Thread(target=lambda: self._safe_wait(), daemon=True).start()
        return self._future

    def _safe_wait(self) -> None:
        try:
            self.wait()
        except BaseException:  # noqa: BLE001 - the future carries it
            pass


def irecv(tensor, src: Optional[int] = None, group=None, tag: int = 0, group_src: Optional[int] = None):
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("irecv")
    peer = _peer(pg, src, group_src, "src", required=False)
    if peer is not None and peer == pg.rank():
        raise ValueError("Invalid source rank: can't receive from self")
    array, tag = _p2p_args(tensor, tag, writable=True)
    backend = _backend(pg, array)
    return _RecvWork(pg, backend.post_recv(array, peer, tag), array)


def recv(tensor, src: Optional[int] = None, group=None, tag: int = 0, group_src: Optional[int] = None) -> int:
    """Receive into ``tensor``; with ``src=None`` from any rank. Returns the sender's global rank."""
    work = irecv(tensor, src, group, tag, group_src)
    if work is None:
        return -1
    work.wait()
    return work.source


class P2POp:
    """One operation of batch_isend_irecv: ``P2POp(isend | irecv, tensor, peer, group, tag)``."""

    def __init__(self, op: Callable, tensor, peer: Optional[int] = None, group=None, tag: int = 0,
                 group_peer: Optional[int] = None):
        if op not in (isend, irecv):
            raise ValueError("Invalid ``op``. Expected ``op`` to be of type ``distlib.isend`` or ``distlib.irecv``.")
        self.op, self.tensor, self.peer, self.group, self.tag, self.group_peer = op, tensor, peer, group, tag, group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def _batch_on_stream(p2p_op_list: List[P2POp]) -> Optional[List[Work]]:
    """cupy arrays on a stream-ordered backend (nccl): every op in one NCCL group, one Work
    (torch returns one coalesced Work too); None when the batch is not such a batch."""
    first = p2p_op_list[0]
    pg = _resolve(first.group)
    if pg is None or check_one_device(first.tensor, [p.tensor for p in p2p_op_list]) != "cuda":
        return None
    backend = pg.backend_for("cuda")
    if backend.kind is not STREAM_ORDERED:
        return None
    items = []
    for p in p2p_op_list:
        receiving = p.op is irecv
        peer = _peer(pg, p.peer, p.group_peer, "src" if receiving else "dst")
        if peer == pg.rank():
            raise ValueError(f"Invalid {'source' if receiving else 'destination'} rank: can't "
                             f"{'receive from' if receiving else 'send to'} self")
        array, _ = _p2p_args(p.tensor, p.tag, writable=receiving)
        items.append((not receiving, array, peer))
    return [backend.batch_p2p(items)]


def batch_isend_irecv(p2p_op_list: List[P2POp]) -> List[Work]:
    """Post every receive first, then start every send; returns the Works in list order (on
    the nccl backend: one NCCL group and one Work, as torch)."""
    if not isinstance(p2p_op_list, list) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("Invalid ``p2p_op_list``. Each op is expected to to be of type ``distlib.P2POp``.")
    if p2p_op_list and not all(p.group is p2p_op_list[0].group for p in p2p_op_list):
        raise ValueError("All ops need to use the same group.")
    if p2p_op_list:
        coalesced = _batch_on_stream(p2p_op_list)
        if coalesced is not None:
            return coalesced
    works: List[Optional[Work]] = [None] * len(p2p_op_list)
    order = [i for i, p in enumerate(p2p_op_list) if p.op is irecv] + \
            [i for i, p in enumerate(p2p_op_list) if p.op is isend]
    for i in order:
        p = p2p_op_list[i]
        if p.op is irecv:
            works[i] = irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer)
        else:
            works[i] = isend(p.tensor, p.peer, p.group, p.tag, p.group_peer)
    return [w for w in works if w is not None]


__all__ = [
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "DistBackendError",
]
