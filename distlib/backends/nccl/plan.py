"""Each collective as the NCCL calls that do it: a plan of steps over regions of buffers.

Why a plan: NCCL has all_reduce, reduce, broadcast, all_gather, reduce_scatter and send/recv;
everything else (gather, scatter, all_to_all with split sizes, list outputs, AVG on an old
NCCL, PREMUL_SUM) is offsets, temporaries and grouped send/recv. Building that as data, in
pure code, keeps the offsets checkable without a GPU (the tests run every plan through a
numpy model of NCCL's primitives), and leaves backend.py a short loop that turns each step into
one cupy call.

A plan's buffers are the operation's arrays, in the order the backend passes them, then the
temporaries it declares (``temps``: element counts). A ``Region`` is a run of elements of one
buffer, counted in the type NCCL sees (a complex64 array is twice as many float32s). Steps:

* ``AllReduce``, ``Reduce``, ``Broadcast``, ``AllGather``, ``ReduceScatter``: one NCCL call
  (AllGather sends ``src.count`` per rank, ReduceScatter receives ``dst.count``).
* ``Group``: its ``Send``/``Recv`` steps between ``ncclGroupStart`` and ``ncclGroupEnd``.
* ``Copy`` (device to device), ``Scale`` (multiply in place), ``Divide`` (by the group size):
  local work on the backend's stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple, Union

from .dtypes import SUM, Reduction, Wire


@dataclass(frozen=True)
class Region:
    buffer: int
    start: int
    count: int


@dataclass(frozen=True)
class AllReduce:
    src: Region
    dst: Region
    op: int


@dataclass(frozen=True)
class Reduce:
    src: Region
    dst: Region
    op: int
    root: int


@dataclass(frozen=True)
class Broadcast:
    src: Region
    dst: Region
    root: int


@dataclass(frozen=True)
class AllGather:
    src: Region
    dst: Region


@dataclass(frozen=True)
class ReduceScatter:
    src: Region
    dst: Region
    op: int


@dataclass(frozen=True)
class Send:
    src: Region
    peer: int


@dataclass(frozen=True)
class Recv:
    dst: Region
    peer: int


@dataclass(frozen=True)
class Group:
    steps: Tuple = ()


@dataclass(frozen=True)
class Copy:
    src: Region
    dst: Region


@dataclass(frozen=True)
class Scale:
    region: Region
    factor: float


@dataclass(frozen=True)
class Divide:
    region: Region
    by: int


#: The steps that talk to other ranks (the rest are local).
COMMUNICATING = (AllReduce, Reduce, Broadcast, AllGather, ReduceScatter, Group)


@dataclass
class Plan:
    wire: Wire
    buffers: int
    temps: List[int] = field(default_factory=list)
    steps: List = field(default_factory=list)

    def temp(self, count: int) -> int:
        """Declare a temporary of ``count`` elements; returns its buffer index."""
        self.temps.append(count)
        return self.buffers + len(self.temps) - 1


def whole(buffer: int, count: int) -> Region:
    return Region(buffer, 0, count)


def _finish_reduction(plan: Plan, how: Reduction, region: Region, size: int) -> None:
    if how.divide:
        plan.steps.append(Divide(region, size))


def _scaled_copy(plan: Plan, how: Reduction, src: Region) -> Region:
    """PREMUL_SUM without touching the caller's input: a scaled copy in a temporary."""
    assert how.premul is not None, "called for PREMUL_SUM only, which carries its factor"
    tmp = whole(plan.temp(src.count), src.count)
    plan.steps += [Copy(src, tmp), Scale(tmp, how.premul)]
    return tmp


# -- reductions ----------------------------------------------------------------------------------


def all_reduce(how: Reduction, count: int, size: int) -> Plan:
    """buffers: [array] (in place)."""
    plan = Plan(how.wire, 1)
    region = whole(0, how.wire.count(count))
    if how.premul is not None:
        plan.steps.append(Scale(region, how.premul))  # overwritten by the result anyway
    plan.steps.append(AllReduce(region, region, how.nccl_op))
    _finish_reduction(plan, how, region, size)
    return plan


def reduce(how: Reduction, count: int, root: int, rank: int, size: int) -> Plan:
    """buffers: [array]; only the root's array changes."""
    plan = Plan(how.wire, 1)
    region = whole(0, how.wire.count(count))
    src = _scaled_copy(plan, how, region) if how.premul is not None else region
    plan.steps.append(Reduce(src, region, how.nccl_op, root))
    if rank == root:
        _finish_reduction(plan, how, region, size)
    return plan


def reduce_scatter_into(how: Reduction, out_count: int, size: int) -> Plan:
    """buffers: [output (out_count), input (size x out_count)]."""
    plan = Plan(how.wire, 2)
    n = how.wire.count(out_count)
    out, src = whole(0, n), whole(1, n * size)
    if how.premul is not None:
        src = _scaled_copy(plan, how, src)
    plan.steps.append(ReduceScatter(src, out, how.nccl_op))
    _finish_reduction(plan, how, out, size)
    return plan


def reduce_scatter(how: Reduction, out_count: int, size: int) -> Plan:
    """buffers: [output, input_0, ..., input_{size-1}] (each out_count): the inputs are packed
    into one temporary, which ReduceScatter needs."""
    plan = Plan(how.wire, 1 + size)
    n = how.wire.count(out_count)
    packed = plan.temp(n * size)
    for k in range(size):
        plan.steps.append(Copy(whole(1 + k, n), Region(packed, k * n, n)))
    src = whole(packed, n * size)
    if how.premul is not None:
        plan.steps.append(Scale(src, how.premul))
    out = whole(0, n)
    plan.steps.append(ReduceScatter(src, out, how.nccl_op))
    _finish_reduction(plan, how, out, size)
    return plan


# -- data movement -------------------------------------------------------------------------------


def broadcast(wire: Wire, count: int, root: int) -> Plan:
    """buffers: [array] (in place)."""
    plan = Plan(wire, 1)
    region = whole(0, wire.count(count))
    plan.steps.append(Broadcast(region, region, root))
    return plan


def all_gather_into(wire: Wire, count: int, size: int) -> Plan:
    """buffers: [output (size x count), input (count)]."""
    plan = Plan(wire, 2)
    n = wire.count(count)
    plan.steps.append(AllGather(whole(1, n), whole(0, n * size)))
    return plan


def all_gather(wire: Wire, count: int, size: int) -> Plan:
    """buffers: [input, output_0, ..., output_{size-1}]: gathered into one temporary, then
    copied out (the outputs need not be adjacent)."""
    plan = Plan(wire, 1 + size)
    n = wire.count(count)
    packed = plan.temp(n * size)
    plan.steps.append(AllGather(whole(0, n), whole(packed, n * size)))
    for k in range(size):
        plan.steps.append(Copy(Region(packed, k * n, n), whole(1 + k, n)))
    return plan


def gather(wire: Wire, count: int, root: int, rank: int, size: int) -> Plan:
    """buffers: [input] on every rank, then output_0..output_{size-1} on the root."""
    n = wire.count(count)
    if rank != root:
        plan = Plan(wire, 1)
        plan.steps.append(Group((Send(whole(0, n), root),)))
        return plan
    plan = Plan(wire, 1 + size)
    plan.steps.append(Group(tuple(Recv(whole(1 + k, n), k) for k in range(size) if k != root)))
    plan.steps.append(Copy(whole(0, n), whole(1 + root, n)))
    return plan


def scatter(wire: Wire, count: int, root: int, rank: int, size: int) -> Plan:
    """buffers: [output] on every rank, then input_0..input_{size-1} on the root."""
    n = wire.count(count)
    if rank != root:
        plan = Plan(wire, 1)
        plan.steps.append(Group((Recv(whole(0, n), root),)))
        return plan
    plan = Plan(wire, 1 + size)
    plan.steps.append(Group(tuple(Send(whole(1 + k, n), k) for k in range(size) if k != root)))
    plan.steps.append(Copy(whole(1 + root, n), whole(0, n)))
    return plan


def all_to_all(wire: Wire, out_counts: Sequence[int], in_counts: Sequence[int], rank: int) -> Plan:
    """buffers: [output_0..output_{n-1}, input_0..input_{n-1}]."""
    size = len(out_counts)
    plan = Plan(wire, 2 * size)
    outs = [whole(k, wire.count(c)) for k, c in enumerate(out_counts)]
    ins = [whole(size + k, wire.count(c)) for k, c in enumerate(in_counts)]
    plan.steps.append(_exchange(outs, ins, rank))
    if outs[rank].count:
        plan.steps.append(Copy(ins[rank], outs[rank]))
    return plan


def split_regions(buffer: int, splits: Sequence[int], per_row: int) -> List[Region]:
    """Consecutive regions of ``buffer``: ``splits[k]`` rows of ``per_row`` elements each."""
    regions, start = [], 0
    for rows in splits:
        count = rows * per_row
        regions.append(Region(buffer, start, count))
        start += count
    return regions


def all_to_all_single(wire: Wire, out_splits: Sequence[int], in_splits: Sequence[int],
                      out_row: int, in_row: int, rank: int) -> Plan:
    """buffers: [output, input]; ``*_row`` is the number of array elements in one row (dim 0)."""
    plan = Plan(wire, 2)
    outs = split_regions(0, out_splits, wire.count(out_row))
    ins = split_regions(1, in_splits, wire.count(in_row))
    plan.steps.append(_exchange(outs, ins, rank))
    if outs[rank].count:
        plan.steps.append(Copy(ins[rank], outs[rank]))
    return plan


def _exchange(outs: Sequence[Region], ins: Sequence[Region], rank: int) -> Group:
    """One group: a send of ins[k] to and a receive of outs[k] from every other rank k, empty
    ones left out (both sides agree on sizes, so both leave the same ones out)."""
    steps: List[Union[Send, Recv]] = []
    for k in range(len(outs)):
        if k == rank:
            continue
        if ins[k].count:
            steps.append(Send(ins[k], k))
        if outs[k].count:
            steps.append(Recv(outs[k], k))
    return Group(tuple(steps))


# -- point to point and barrier ------------------------------------------------------------------


def send(wire: Wire, count: int, peer: int) -> Plan:
    plan = Plan(wire, 1)
    plan.steps.append(Group((Send(whole(0, wire.count(count)), peer),)))
    return plan


def recv(wire: Wire, count: int, peer: int) -> Plan:
    plan = Plan(wire, 1)
    plan.steps.append(Group((Recv(whole(0, wire.count(count)), peer),)))
    return plan


def batch_p2p(wire: Wire, items: Sequence[Tuple[bool, int, int]]) -> Plan:
    """``items``: (is_send, element count, peer) per buffer, in buffer order; one group."""
    plan = Plan(wire, len(items))
    steps = []
    for index, (is_send, count, peer) in enumerate(items):
        region = whole(index, wire.count(count))
        steps.append(Send(region, peer) if is_send else Recv(region, peer))
    plan.steps.append(Group(tuple(steps)))
    return plan


def barrier(wire: Wire) -> Plan:
    """An all_reduce of one element of a temporary (what torch's ProcessGroupNCCL does)."""
    plan = Plan(wire, 0)
    one = whole(plan.temp(1), 1)
    plan.steps.append(AllReduce(one, one, SUM))
    return plan

