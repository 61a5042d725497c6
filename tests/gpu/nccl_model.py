"""A numpy model of NCCL's primitives, to run the nccl backend's plans for every rank at once.

Not a GPU and not a backend: an oracle for the plans' offsets, temporaries and step order.
Each NCCL call is what NCCL documents it to be (allReduce: every rank's dst = op over every
rank's src, in rank order; reduceScatter: rank r gets chunk r; a group's send and receive
between two ranks match in issue order and must have the same count). Local steps (Copy,
Scale, Divide) run as soon as a rank reaches them; a communicating step runs when every rank
has reached one, and they must all be of the same kind, as NCCL requires.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from distlib.backends.nccl import dtypes as T
from distlib.backends.nccl import plan as P

_REDUCE = {T.SUM: np.add, T.PROD: np.multiply, T.MAX: np.maximum, T.MIN: np.minimum}


def _get(buffers, region: P.Region) -> np.ndarray:
    return buffers[region.buffer][region.start:region.start + region.count]


def _reduce(op: int, parts: List[np.ndarray]) -> np.ndarray:
    if op == T.AVG:
        total = _reduce(T.SUM, parts)
        return (total / len(parts)).astype(total.dtype)
    out = parts[0].copy()
    for part in parts[1:]:
        _REDUCE[op](out, part, out=out)
    return out


def _local(step, buffers) -> None:
    if isinstance(step, P.Copy):
        assert step.src.count == step.dst.count
        _get(buffers, step.dst)[...] = _get(buffers, step.src)
    elif isinstance(step, P.Scale):
        region = _get(buffers, step.region)
        region[...] = region * region.dtype.type(step.factor)
    elif isinstance(step, P.Divide):
        region = _get(buffers, step.region)
        np.divide(region, step.by, out=region, casting="unsafe")
    else:
        raise AssertionError(f"not a local step: {step}")


def _group(steps_by_rank, buffers_by_rank) -> None:
    sends: Dict[Tuple[int, int], List[np.ndarray]] = {}
    recvs: Dict[Tuple[int, int], List[P.Region]] = {}
    for rank, group in enumerate(steps_by_rank):
        for step in group.steps:
            if isinstance(step, P.Send):
                sends.setdefault((rank, step.peer), []).append(_get(buffers_by_rank[rank], step.src).copy())
            elif isinstance(step, P.Recv):
                recvs.setdefault((step.peer, rank), []).append(step.dst)
            else:
                raise AssertionError(f"only Send and Recv belong in a group, got {step}")
    assert set(sends) == set(recvs), f"unmatched point-to-point: sends {sorted(sends)}, receives {sorted(recvs)}"
    for (src, dst), payloads in sends.items():
        regions = recvs[(src, dst)]
        assert len(payloads) == len(regions), f"{src}->{dst}: {len(payloads)} sends, {len(regions)} receives"
        for payload, region in zip(payloads, regions, strict=True):
            assert payload.size == region.count, f"{src}->{dst}: send of {payload.size}, receive of {region.count}"
            _get(buffers_by_rank[dst], region)[...] = payload


def _collective(steps, buffers_by_rank) -> None:
    kinds = {type(s) for s in steps}
    assert len(kinds) == 1, f"ranks disagree on the collective: {steps}"
    kind, n = kinds.pop(), len(steps)
    if kind is P.Group:
        return _group(steps, buffers_by_rank)
    srcs = [_get(buffers_by_rank[r], s.src).copy() for r, s in enumerate(steps)]
    assert len({x.size for x in srcs}) == 1, "ranks disagree on the count"
    if kind is P.AllReduce:
        result = _reduce(steps[0].op, srcs)
        for r, s in enumerate(steps):
            _get(buffers_by_rank[r], s.dst)[...] = result
    elif kind is P.Reduce:
        root = steps[0].root
        _get(buffers_by_rank[root], steps[root].dst)[...] = _reduce(steps[0].op, srcs)
    elif kind is P.Broadcast:
        root = steps[0].root
        for r, s in enumerate(steps):
            _get(buffers_by_rank[r], s.dst)[...] = srcs[root]
    elif kind is P.AllGather:
        for r, s in enumerate(steps):
            assert s.dst.count == n * s.src.count
            _get(buffers_by_rank[r], s.dst)[...] = np.concatenate(srcs)
    elif kind is P.ReduceScatter:
        total = _reduce(steps[0].op, srcs)
        for r, s in enumerate(steps):
            assert s.src.count == n * s.dst.count
            _get(buffers_by_rank[r], s.dst)[...] = total[r * s.dst.count:(r + 1) * s.dst.count]
    else:
        raise AssertionError(f"unknown step {kind}")


def run(plans: List[P.Plan], arrays_by_rank: List[List[np.ndarray]]) -> None:
    """Run every rank's plan on its arrays (numpy, changed in place, as the GPU's would be)."""
    buffers_by_rank = []
    for plan, arrays in zip(plans, arrays_by_rank, strict=True):
        assert len(arrays) == plan.buffers, f"plan wants {plan.buffers} arrays, got {len(arrays)}"
        view = np.dtype(plan.wire.view)
        flat = [a.reshape(-1).view(view) for a in arrays]
        flat += [np.full(count, 99, dtype=view) for count in plan.temps]  # garbage, as cupy.empty
        buffers_by_rank.append(flat)
    pcs = [0] * len(plans)
    while True:
        for r, plan in enumerate(plans):
            while pcs[r] < len(plan.steps) and not isinstance(plan.steps[pcs[r]], P.COMMUNICATING):
                _local(plan.steps[pcs[r]], buffers_by_rank[r])
                pcs[r] += 1
        finished = [pcs[r] == len(plan.steps) for r, plan in enumerate(plans)]
        if all(finished):
            return
        assert not any(finished), f"some ranks have more collectives than others: {finished}"
        _collective([plan.steps[pcs[r]] for r, plan in enumerate(plans)], buffers_by_rank)
        pcs = [pc + 1 for pc in pcs]
