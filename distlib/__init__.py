"""distlib: torch.distributed's process-group layer on numpy (and cupy) arrays.

Names, arguments and errors follow torch.distributed, so code written against it reads the
same: ``import distlib as dist``. The store layer and the errors load at import; the
process-group API (and numpy) loads on first use, so that ``distlib store-server --ping``, a
container healthcheck run every few seconds, starts fast.
"""

from importlib import import_module

from .errors import DistBackendError, DistError, DistNetworkError, DistStoreError, QueueEmptyError
from .rendezvous import register_rendezvous_handler, rendezvous
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore

__version__ = "0.1.0"

_LAZY = {
    # process groups
    "init_process_group": "distributed", "destroy_process_group": "distributed", "new_group": "distributed",
    "is_initialized": "distributed", "is_available": "distributed", "is_gloo_available": "distributed",
    "is_nccl_available": "distributed", "is_mpi_available": "distributed", "is_ucc_available": "distributed",
    "is_backend_available": "distributed", "is_torchelastic_launched": "distributed",
    "get_node_local_rank": "distributed", "get_rank": "distributed",
    "get_world_size": "distributed", "get_backend": "distributed", "get_process_group_ranks": "distributed",
    "get_global_rank": "distributed", "get_group_rank": "distributed", "default_pg_timeout": "distributed",
    "default_pg_nccl_timeout": "distributed",
    "GroupMember": "group", "ProcessGroup": "group",
    "Backend": "backends.registry", "CommBackend": "backends.base", "RecvHandle": "backends.base",
    "StreamOrderedBackend": "backends.base", "BackendKind": "backends.base",
    "ReduceOp": "reduce_op", "_make_nccl_premul_sum": "reduce_op",
    "Work": "work", "Future": "work",
    # collectives
    "broadcast": "collectives", "all_reduce": "collectives", "reduce": "collectives",
    "all_gather": "collectives", "all_gather_into_tensor": "collectives", "gather": "collectives",
    "scatter": "collectives", "reduce_scatter": "collectives", "reduce_scatter_tensor": "collectives",
    "all_to_all": "collectives", "all_to_all_single": "collectives", "barrier": "collectives",
    "monitored_barrier": "collectives", "send": "collectives", "recv": "collectives", "isend": "collectives",
    "irecv": "collectives", "P2POp": "collectives", "batch_isend_irecv": "collectives",
    "broadcast_object_list": "object_collectives", "all_gather_object": "object_collectives",
    "gather_object": "object_collectives", "scatter_object_list": "object_collectives",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distlib' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "DistError", "DistStoreError", "DistNetworkError", "DistBackendError", "QueueEmptyError",
    "Store", "HashStore", "PrefixStore", "FileStore", "TCPStore", "rendezvous", "register_rendezvous_handler",
    *_LAZY,
]
