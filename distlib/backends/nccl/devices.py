"""Which GPU a rank's NCCL communicator uses, by the rules torch users expect.

In order: ``init_process_group(device_id=...)`` binds the group to a device (an array on
another one is an error); else the device of the array of the first collective; else, for a
call without arrays (barrier, object collectives), ``LOCAL_RANK`` (the process's identity,
distlib/identity.py, as the backend's creator gives it) — what a launcher sets, so
eight ranks on an eight-GPU node spread over the GPUs instead of all landing on GPU 0 —
modulo the number of visible devices (torch's fallback is the rank modulo that number); else
the current cupy device. Once a communicator exists, every array must be on its device.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ...identity import Identity


def parse_device_id(device_id, device_count: Optional[int] = None) -> Optional[int]:
    """``device_id`` as a CUDA device index, or None for none / a CPU device.

    Accepts an int, ``"cuda:N"``, ``"cpu"`` and any object with an integer ``id`` (a
    ``cupy.cuda.Device``). torch's texts for a device without an index and one out of range.
    """
    if device_id is None:
        return None
    if isinstance(device_id, bool):
        raise TypeError(f"device_id must be an int or a device, got {device_id!r}")
    if isinstance(device_id, int):
        index = device_id
    elif isinstance(getattr(device_id, "id", None), int):
        index = device_id.id
    elif isinstance(device_id, str):
        kind, _, number = device_id.strip().lower().partition(":")
        if kind == "cpu":
            return None
        if kind != "cuda":
            raise ValueError(f"device_id {device_id!r} does not match the accelerator distlib supports (cuda): "
                             f"use an int, 'cuda:N' or a cupy.cuda.Device")
        if not number:
            raise ValueError("Please use a device_id with index.")
        if not number.isdigit():
            raise ValueError(f"device_id {device_id!r}: the index after 'cuda:' must be a non-negative int")
        index = int(number)
    else:
        raise TypeError(f"device_id must be an int, 'cuda:N' or a cupy.cuda.Device, got {type(device_id).__name__}")
    if index < 0:
        raise ValueError(f"device_id {index} must not be negative")
    if device_count is not None and index >= device_count:
        raise ValueError(f"device_id cuda:{index} is out of range. Please use a device index less than the number "
                         f"of accelerators available: {device_count}.")
    return index


def local_rank(identity: Identity) -> Optional[int]:
    """This rank's index on its node (None: nobody said); a ValueError naming the variable if
    what the launcher set is not a non-negative integer."""
    if "local_rank" in identity.problems:
        raise ValueError(f"{identity.problems['local_rank']} (a launcher sets LOCAL_RANK to the rank's index on "
                         f"its node)")
    value = identity.local_rank
    if value is not None and value < 0:
        raise ValueError(f"LOCAL_RANK={value} is negative (a launcher sets it to the rank's index on its node)")
    return value


def choose_device(array_device: Optional[int], bound: Optional[int], identity: Identity, current: int,
                  count: int) -> Tuple[int, str]:
    """(device, why) for a new communicator, by the rules of the module docstring."""
    if bound is not None:
        if array_device is not None and array_device != bound:
            raise ValueError(f"the array is on cuda:{array_device}, but the process group is bound to "
                             f"cuda:{bound} (init_process_group(device_id=...)): move the array to cuda:{bound}")
        return bound, f"device_id={bound}"
    if array_device is not None:
        return array_device, "the array's device"
    rank_here = local_rank(identity)
    if rank_here is not None and count > 0:
        return rank_here % count, f"LOCAL_RANK={rank_here} of {count} visible device(s)"
    return current, "the current cupy device"


def check_same_device(array_device: int, comm_device: int, name: str, label: str) -> None:
    """An array on another GPU than the communicator's is an error before anything is enqueued."""
    if array_device != comm_device:
        raise ValueError(f"{name} is on cuda:{array_device}, but {label}'s NCCL communicator is on "
                         f"cuda:{comm_device}: a group uses one GPU per rank; move the array (cupy.asarray under "
                         f"cupy.cuda.Device({comm_device})) or make another group for the other GPU")


def shared_gpus_hint(records) -> str:
    """A sentence for an NCCL init failure when ranks of one host use one GPU ("" otherwise);
    ``records``: the ranks' join records (hostname, device)."""
    users: Dict[Tuple[Optional[str], Optional[int]], List[int]] = {}
    for rank, record in enumerate(records):
        users.setdefault((record.get("hostname"), record.get("device")), []).append(rank)
    for (host, device), ranks in users.items():
        if len(ranks) > 1:
            return (f". Ranks {', '.join(map(str, ranks))} all use cuda:{device} on {host}: NCCL refuses two ranks "
                    f"of one communicator on one GPU ('Duplicate GPU detected') unless each rank has its own "
                    f"NCCL_HOSTID or NCCL_MULTI_RANK_GPU_ENABLE=1 is set (NCCL 2.30 and later), both meant for "
                    f"tests; give each rank its own GPU (init_process_group(device_id=LOCAL_RANK))")
    return ""
