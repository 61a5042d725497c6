"""Collectives of picklable Python objects: broadcast_object_list, all_gather_object,
gather_object, scatter_object_list.

As in torch: objects are pickled into uint8 arrays, their sizes are exchanged first, and the
bytes travel as ordinary array collectives. Unpickling runs code chosen by the sender: use
these only between ranks that trust each other (torch's warning, repeated).

Where the bytes live follows torch's rule: a group with a CPU backend (gloo, or
"cpu:gloo,cuda:nccl") uses host memory; a GPU-only group (nccl) uses arrays on its device,
which the backend provides (``object_arrays()``), and copies the results back to the host.
"""

from __future__ import annotations

import pickle
from typing import Any, List, Optional

import numpy as np

from . import collectives as C
from .backends.base import HostObjectArrays
from .distributed import _resolve, warn_not_in_group


def _arrays_for(pg):
    """Host arrays where the group has a CPU backend (torch's rule), else the backend's own."""
    if "cpu" in pg.backends:
        return HostObjectArrays
    return next(iter(pg.backends.values())).object_arrays()


def _to_array(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj), dtype=np.uint8).copy()


def _from_array(array: np.ndarray, size: int) -> Any:
    return pickle.loads(array[:size].tobytes())


def broadcast_object_list(object_list: List[Any], src: Optional[int] = None, group=None, device=None,
                          group_src: Optional[int] = None) -> None:
    """Replace ``object_list``'s items on every rank with those of the source rank."""
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("broadcast_object_list")
    root = C._peer(pg, src, group_src, "src")
    kit = _arrays_for(pg)
    count = len(object_list)
    if pg.rank() == root:
        arrays = [_to_array(obj) for obj in object_list]
        sizes = np.array([a.size for a in arrays], dtype=np.int64)
    else:
        arrays = []
        sizes = np.zeros(count, dtype=np.int64)
    sizes_here = kit.put(sizes)
    C.broadcast(sizes_here, group_src=root, group=group)
    sizes = kit.get(sizes_here)
    payload = np.concatenate(arrays) if pg.rank() == root and arrays else np.empty(int(sizes.sum()), np.uint8)
    payload_here = kit.put(payload)
    C.broadcast(payload_here, group_src=root, group=group)
    payload = kit.get(payload_here)
    if pg.rank() != root:
        offset = 0
        for i, size in enumerate(sizes.tolist()):
            object_list[i] = pickle.loads(payload[offset:offset + size].tobytes())
            offset += size


def _padded_to_longest(pg, group, kit, obj: Any):
    """(every rank's pickled size, the longest, this rank's pickle padded to it): the sizes
    are gathered first so every rank sends the same number of bytes."""
    mine = _to_array(obj)
    sizes = kit.put(np.zeros(pg.size(), dtype=np.int64))
    C.all_gather_into_tensor(sizes, kit.put(np.array([mine.size], dtype=np.int64)), group=group)
    sizes = kit.get(sizes)
    longest = int(sizes.max())
    padded = np.zeros(longest, np.uint8)
    padded[: mine.size] = mine
    return sizes, longest, padded


def all_gather_object(object_list: List[Any], obj: Any, group=None) -> None:
    """``object_list[k]`` becomes rank k's ``obj`` on every rank."""
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("all_gather_object")
    if len(object_list) != pg.size():
        raise ValueError(f"object_list has {len(object_list)} items but the group has {pg.size()} ranks")
    kit = _arrays_for(pg)
    sizes, longest, padded = _padded_to_longest(pg, group, kit, obj)
    everything = kit.put(np.empty(longest * pg.size(), np.uint8))
    C.all_gather_into_tensor(everything, kit.put(padded), group=group)
    everything = kit.get(everything)
    for k in range(pg.size()):
        object_list[k] = _from_array(everything[k * longest:(k + 1) * longest], int(sizes[k]))


def gather_object(obj: Any, object_gather_list: Optional[List[Any]] = None, dst: Optional[int] = None,
                  group=None, group_dst: Optional[int] = None) -> None:
    """On the destination, ``object_gather_list[k]`` becomes rank k's ``obj``."""
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("gather_object")
    root = C._peer(pg, dst, group_dst, "dst", required=False)
    root = 0 if root is None else root
    if pg.rank() == root and (object_gather_list is None or len(object_gather_list) != pg.size()):
        raise ValueError(f"object_gather_list must be a list of {pg.size()} items on the destination rank")
    kit = _arrays_for(pg)
    sizes, longest, padded = _padded_to_longest(pg, group, kit, obj)
    outputs = [kit.put(np.empty(longest, np.uint8)) for _ in range(pg.size())] if pg.rank() == root else None
    C.gather(kit.put(padded), outputs, group_dst=root, group=group)
    if outputs is not None and object_gather_list is not None:  # the destination (checked above)
        for k in range(pg.size()):
            object_gather_list[k] = _from_array(kit.get(outputs[k]), int(sizes[k]))


def scatter_object_list(scatter_object_output_list: List[Any], scatter_object_input_list: Optional[List[Any]] = None,
                        src: Optional[int] = None, group=None, group_src: Optional[int] = None) -> None:
    """``scatter_object_output_list[0]`` becomes item k of the source's input list, on rank k."""
    pg = _resolve(group)
    if pg is None:
        return warn_not_in_group("scatter_object_list")
    root = C._peer(pg, src, group_src, "src", required=False)
    root = 0 if root is None else root
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("Expected argument scatter_object_output_list to be a list of size at least 1.")
    kit = _arrays_for(pg)
    if pg.rank() == root:
        if scatter_object_input_list is None or len(scatter_object_input_list) != pg.size():
            raise ValueError(f"scatter_object_input_list must have {pg.size()} items on the source rank")
        arrays = [_to_array(o) for o in scatter_object_input_list]
        longest = np.array([max(a.size for a in arrays)], dtype=np.int64)
    else:
        arrays = None
        longest = np.zeros(1, dtype=np.int64)
    longest = kit.put(longest)
    C.broadcast(longest, group_src=root, group=group)
    n = int(kit.get(longest)[0])
    size = kit.put(np.zeros(1, dtype=np.int64))
    sizes = [kit.put(np.array([a.size], dtype=np.int64)) for a in arrays] if arrays else None
    C.scatter(size, sizes, group_src=root, group=group)
    padded = None
    if arrays:
        padded = []
        for a in arrays:
            p = np.zeros(n, np.uint8)
            p[: a.size] = a
            padded.append(kit.put(p))
    out = kit.put(np.empty(n, np.uint8))
    C.scatter(out, padded, group_src=root, group=group)
    scatter_object_output_list[0] = _from_array(kit.get(out), int(kit.get(size)[0]))
