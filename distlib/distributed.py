"""init_process_group, destroy_process_group, new_group and the questions about groups —
torch.distributed's names, arguments, defaults and errors.

The collectives themselves are in collectives.py and object_collectives.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import warnings
from datetime import timedelta
from typing import Dict, List, Optional

from .backends import cupy_env
from .backends.base import AnyBackend, CommBackend, StreamOrderedBackend
from .backends.nccl.devices import parse_device_id
from .backends.registry import Backend, backend_config, config_string
from .deadline import format_duration
from .errors import DistBackendError
from .group import NON_GROUP_MEMBER, GroupMember, ProcessGroup, world
from .identity import Identity
from .rendezvous import check_rank, check_types, default_pg_timeout, rendezvous
from .store.chain import close_quietly
from .store.prefix import PrefixStore

log = logging.getLogger("distlib.distributed")

#: torch's default for NCCL groups.
default_pg_nccl_timeout = timedelta(minutes=10)


# -- availability ---------------------------------------------------------------------------------


def is_available() -> bool:
    return True


def is_gloo_available() -> bool:
    return True


def is_nccl_available() -> bool:
    """True where cupy imports and its NCCL library loads (a device is checked at init, as
    torch's is True for a CUDA build on a machine without a GPU)."""
    return cupy_env.status().nccl_loads


def is_mpi_available() -> bool:
    """Whether mpi4py imports and loads an MPI library (it does not initialise MPI)."""
    from .backends.mpi import runtime as mpi_runtime

    return mpi_runtime.available()


def is_ucc_available() -> bool:
    return False


def is_backend_available(backend: str) -> bool:
    name = Backend(backend)
    if name == Backend.GLOO:
        return True
    if name == Backend.MPI:
        return is_mpi_available()
    if name == Backend.NCCL:
        return is_nccl_available()
    return Backend.plugin(name) is not None


def is_initialized() -> bool:
    return world.default_pg is not None


def is_torchelastic_launched() -> bool:
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def get_node_local_rank(fallback_rank: Optional[int] = None) -> int:
    """This process's rank on its node (torch's): ``LOCAL_RANK``; inside an ``srun`` step, where
    no launcher set it, ``SLURM_LOCALID`` (identity.py); else ``fallback_rank``; else torch's
    RuntimeError. The way to pick a GPU per process, before or after init_process_group."""
    identity = Identity.read()
    if "local_rank" in identity.problems:  # LOCAL_RANK=x, or Slurm's variables contradicting each other
        raise ValueError(identity.problems["local_rank"])
    if identity.local_rank is not None:
        return identity.local_rank
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError("LOCAL_RANK is not in the environment. Consider passing fallback_rank to allow "
                       "`get_node_local_rank` to work, assuming you are not running in a multi-device context and "
                       "want the code to run locally instead.")


def get_identity() -> Identity:
    """Who this process is (distlib's, not torch's): after init_process_group, the identity the
    default group was made with — its rank and size, and the master, the node, the local rank
    and the run as they were read from the environment (torch's variables, or srun's) — else
    the environment's now. Nothing is read from ``os.environ`` twice and nothing is written to
    it: under srun, ``RANK`` or ``MASTER_ADDR`` are not in ``os.environ`` after init, and code
    that wants them asks here (identity.py)."""
    with world.lock:
        if world.identity is not None:
            return world.identity
    return Identity.read()


def _available_devices() -> List[str]:
    """What ``backend=None`` maps: cpu, and cuda where a GPU can run NCCL (torch 2.x's
    "cpu:gloo,cuda:nccl")."""
    return ["cpu", "cuda"] if cupy_env.status().usable else ["cpu"]


def _config_for(backend: Optional[str]) -> Dict[str, str]:
    """device -> backend name; the devices are probed only for ``backend=None``."""
    if backend is None:
        return backend_config(Backend.UNDEFINED, _available_devices())
    return backend_config(Backend(backend), ["cpu"])


# -- creating backends ----------------------------------------------------------------------------


def _create_backend(name: str, store, rank: int, size: int, timeout: timedelta, label: str,
                    group_name: str, global_ranks: List[int], pg_options, device_id=None,
                    identity: Identity = Identity()) -> AnyBackend:
    """The backend ``name`` of one group; gloo and nccl get this process's ``identity`` (its node
    and local rank): no backend reads the launcher's variables itself."""
    if name == Backend.GLOO:
        from .backends.gloo.backend import GlooBackend

        return GlooBackend(_needs_store(store, name), rank, size, timeout, label=label, identity=identity)
    if name == Backend.MPI:
        from .backends.mpi.backend import MPIBackend

        return MPIBackend(rank, size, timeout, global_ranks, label=label)
    if name == Backend.NCCL:
        from .backends.nccl.backend import NcclBackend

        return NcclBackend(_needs_store(store, name), rank, size, timeout, label=label, device_id=device_id,
                           identity=identity)
    plugin = Backend.plugin(name)
    if plugin is not None:
        if plugin.extended_api:
            from types import SimpleNamespace

            options = SimpleNamespace(store=store, group_rank=rank, group_size=size, timeout=timeout,
                                      group_id=group_name, global_ranks_in_group=global_ranks)
            backend = plugin.creator_fn(options, pg_options)
        else:
            backend = plugin.creator_fn(_needs_store(store, name), rank, size, timeout)
        if not isinstance(backend, (CommBackend, StreamOrderedBackend)):  # BackendBase alone is neither kind
            raise TypeError(f"the creator of backend {name!r} returned {type(backend).__name__}, "
                            f"not a distlib.CommBackend (or distlib.StreamOrderedBackend)")
        return backend
    if name in (Backend.UCC, Backend.XCCL):
        raise RuntimeError(
            f"backend {name!r} is not available in distlib yet (is_{name}_available() is False); "
            f"use 'gloo' for numpy arrays")
    raise AssertionError(f"Unknown c10d backend type {name.upper()}")


def _needs_store(store, name: str):
    if store is None:
        raise ValueError(f"backend {name!r} needs a store, but the default process group was initialised with the "
                         f"mpi backend, which has none: use backend='mpi' for this group too")
    return store


def _prefixed(prefix: str, store):
    """``PrefixStore(prefix, store)``; None stays None (the mpi backend's groups have no store)."""
    return None if store is None else PrefixStore(prefix, store)


def _only_mpi(config: Dict[str, str]) -> bool:
    return bool(config) and all(b == Backend.MPI for b in config.values())


def _new_process_group(name: str, global_ranks: List[int], group_rank: int, store, config: Dict[str, str],
                       timeout: timedelta, pg_options, device_id: Optional[int] = None,
                       identity: Identity = Identity()) -> ProcessGroup:
    """Create the backends of one group (the group's store is ``store/<name>/``)."""
    group_store = _prefixed(name + "/", store)
    size = len(global_ranks)
    backends: Dict[str, AnyBackend] = {}
    names = set(config.values())
    created: List[AnyBackend] = []
    try:
        if len(names) == 1:
            device, backend_name = next(iter(config.items()))
            backend = _create_backend(backend_name, _prefixed(device + "/", group_store), group_rank, size,
                                      timeout, f"pg{name}/{backend_name}", name, global_ranks, pg_options, device_id,
                                      identity)
            created.append(backend)
            backends = {d: backend for d in config}
        else:
            for device, backend_name in config.items():
                backend = _create_backend(backend_name, _prefixed(device + "/", group_store), group_rank, size,
                                          timeout, f"pg{name}/{backend_name}", name, global_ranks, pg_options,
                                          device_id, identity)
                created.append(backend)
                backends[device] = backend
    except BaseException:
        for backend in created:
            backend.shutdown()
        raise
    pg = ProcessGroup(name, global_ranks, group_rank, group_store, config_string(config), backends, timeout)
    pg.bound_device_id = device_id
    return pg


def _default_timeout(config: Dict[str, str]) -> timedelta:
    if config and all(b == Backend.NCCL for b in config.values()):
        return default_pg_nccl_timeout
    return default_pg_timeout


# -- init / destroy -------------------------------------------------------------------------------


def _launcher_init_method(identity: Identity, rank: int, world_size: int):
    """(init method, rank, world size) for an init_process_group() given neither init_method nor
    store: ``DISTLIB_INIT_METHOD`` when set (distlib-run passes it on in the Compose cluster's and
    the Helm chart's file modes, where no TCP store runs and MASTER_ADDR may be this host's own
    loopback), with the launcher's RANK and WORLD_SIZE where the caller gave none (a file:// URL
    takes them from no variable, as in torch); else ``env://``, as torch does."""
    url = identity.init_method
    if not url:
        return "env://", rank, world_size
    if rank < 0 and identity.rank is not None and identity.rank >= 0:
        rank = identity.rank
    if world_size < 0 and identity.world_size is not None and identity.world_size >= 0:
        world_size = identity.world_size
    log.info("init_process_group: init_method %s from DISTLIB_INIT_METHOD (rank %d, world size %d)", url, rank,
             world_size)
    return url, rank, world_size


def init_process_group(backend: Optional[str] = None, init_method: Optional[str] = None,
                       timeout: Optional[timedelta] = None, world_size: int = -1, rank: int = -1,
                       store=None, group_name: str = "", pg_options=None, device_id=None) -> None:
    """Join the default process group (torch.distributed.init_process_group).

    Blocks until every rank has joined (logging progress every few seconds); on timeout the
    error names the ranks that never arrived. ``init_method`` and ``store`` are mutually
    exclusive; with neither, ``DISTLIB_INIT_METHOD`` when the launcher set it (a file mode: the
    rendezvous is that FileStore), else ``env://`` as in torch. ``backend`` None picks by
    device: gloo for cpu, and nccl for cuda where a GPU can run it ("cpu:gloo,cuda:nccl"), or nccl alone with a cuda
    ``device_id``. ``device_id`` (an int, "cuda:N" or a cupy Device) binds the group to that GPU
    and makes the NCCL communicator now rather than at the first collective.
    To rendezvous through a standing ``distlib store-server`` rather than a store hosted by
    rank 0, set ``TORCHELASTIC_USE_AGENT_STORE=True`` or ``DISTLIB_EXTERNAL_STORE=1`` (or add
    ``external_store=1`` to a tcp:// URL); see rendezvous.py.
    """
    with world.lock:
        if world.default_pg is not None:
            raise ValueError("trying to initialize the default process group twice!")
        if init_method is not None and store is not None:
            raise ValueError("Cannot specify both init_method and store.")
        check_types(rank, world_size)
        identity = Identity.read(os.environ, rank, world_size)  # who this process is: read once, here
        if store is not None:
            if world_size <= 0:
                raise ValueError("world_size must be positive if using store")
            if rank < 0:
                raise ValueError("rank must be non-negative if using store")
            check_rank(rank, world_size, f"rank={rank}, from the rank= argument",
                       f"world_size={world_size}, from the world_size= argument")
        elif init_method is None:
            init_method, rank, world_size = _launcher_init_method(identity, rank, world_size)
        device_id = parse_device_id(device_id)
        if backend is None and device_id is not None:
            backend = Backend.NCCL  # torch: the default backend of the device's type
        config = _config_for(backend)
        if timeout is None:
            timeout = _default_timeout(config)
        if not isinstance(timeout, timedelta):
            raise TypeError(f"Expected timeout argument to be of type datetime.timedelta, got {timeout}")
        from .debug import configure as configure_logging

        if _only_mpi(config):  # as torch: no rendezvous, no store; MPI says who is who
            from .backends.mpi import runtime as mpi_runtime

            rank, world_size = mpi_runtime.world_rank_and_size(rank, world_size)
        # the log prefix's rank: the identity's (RANK, or srun's task rank) until env:// has said
        configure_logging(rank if rank >= 0 else identity.rank if identity.rank is not None else -1)
        name = str(world.group_count)
        world.group_count += 1
        started = time.monotonic()
        if _only_mpi(config):
            store, owns_store = None, False
        elif store is None:
            store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout,
                                                      wait_for_workers=False, identity=identity))
            store.set_timeout(timeout)
            store = PrefixStore("default_pg", store)
            owns_store = True
        else:
            owns_store = False
        try:
            pg = _new_process_group(name, list(range(world_size)), rank, store, config, timeout, pg_options,
                                    device_id, identity)
        except BaseException:
            if owns_store:
                close_quietly(store)
            raise
        world.default_pg = pg
        world.default_store = store
        world.groups[name] = pg
        world.backend_config = config
        world.init_method = init_method
        world.owns_store = owns_store
        world.identity = identity.with_values(rank=rank, world_size=world_size)
        log.info("rank %d/%d joined process group %s (%s) in %s", rank, world_size, name, pg.backend_name,
                 format_duration(time.monotonic() - started))


def destroy_process_group(group=None) -> None:
    """Release a group's sockets, threads, shared memory and communicators; with no group,
    every group.

    As torch >= 2.6, operations already issued keep their results: a GPU group waits for its
    enqueued operations (within its timeout) before it destroys its communicator, and aborts
    only when the group has already failed or the wait runs out. Works after a failed
    collective too (torch leaves that unsupported), so a process can init again.
    """
    _teardown(group, ProcessGroup.shutdown)


def _abort_process_group(group=None) -> None:
    """Abort a group now, dropping what is pending (torch's ``_abort_process_group``); with no
    group (or WORLD), every group. The group is gone afterwards, as after destroy."""
    _teardown(group, ProcessGroup.abort)


def _teardown(group, how) -> None:
    with world.lock:
        if group is NON_GROUP_MEMBER:
            return
        if group is None or group is world.default_pg:
            if world.default_pg is None:
                raise ValueError("Invalid process group specified")
            for name in sorted(world.groups, key=lambda n: (len(n), n), reverse=True):
                how(world.groups[name])
            if world.owns_store:
                close_quietly(world.default_store)
            world.reset()
            return
        if not isinstance(group, ProcessGroup) or world.groups.get(group.group_name) is not group:
            raise ValueError("Invalid process group specified")
        how(group)
        del world.groups[group.group_name]


# -- groups ---------------------------------------------------------------------------------------


def _require_init() -> ProcessGroup:
    if world.default_pg is None:
        raise ValueError("Default process group has not been initialized, please make sure to call "
                         "init_process_group.")
    return world.default_pg


def _resolve(group) -> Optional[ProcessGroup]:
    """The ProcessGroup for ``group`` (None/WORLD → default), or None for non-members."""
    default = _require_init()
    if group is None or group is GroupMember.WORLD:
        return default
    if group is NON_GROUP_MEMBER:
        return None
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup from new_group, got {type(group).__name__}")
    if group.destroyed:
        raise ValueError(f"process group {group.group_name} was destroyed")
    return group


def new_group(ranks: Optional[List[int]] = None, timeout: Optional[timedelta] = None,
              backend: Optional[str] = None, pg_options=None, use_local_synchronization: bool = False,
              group_desc: Optional[str] = None, device_id=None):
    """A subgroup of the default group. Every rank must call it, in the same order, unless
    ``use_local_synchronization`` (then only members). Non-members get NON_GROUP_MEMBER."""
    with world.lock:
        default = _require_init()
        size = default.size()
        if ranks is None:
            ranks = list(range(size))
        ranks = sorted(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks list must not contain duplicate entries, got {ranks}")
        if len(ranks) > size:
            raise ValueError(f"the new group's rank list ({len(ranks)} ranks) should be less or equal to "
                             f"the world size ({size})")
        for r in ranks:
            if not 0 <= r < size:
                raise ValueError(f"Rank {r} is out of range. Valid ranks are 0 to {size - 1} (world_size={size})")
        me = default.rank()
        if use_local_synchronization:
            if me not in ranks:
                return None
            text = "_".join(str(r) for r in ranks) + "_" + str(len(world.groups))
            name = hashlib.sha1(text.encode()).hexdigest()
        else:
            name = str(world.group_count)
            world.group_count += 1
            if me not in ranks:
                return NON_GROUP_MEMBER
        if name in world.groups:
            raise ValueError("The specified group name has already been created, please use a different group name")
        config = _config_for(backend) if backend is not None else dict(world.backend_config)
        timeout = timeout if timeout is not None else default.timeout
        device_id = parse_device_id(device_id) if device_id is not None else default.bound_device_id
        pg = _new_process_group(name, ranks, ranks.index(me), world.default_store, config, timeout, pg_options,
                                device_id, world.identity or Identity())
        world.groups[name] = pg
        return pg


def get_rank(group=None) -> int:
    pg = _resolve(group)
    return -1 if pg is None else pg.rank()


def get_world_size(group=None) -> int:
    pg = _resolve(group)
    return -1 if pg is None else pg.size()


def get_backend(group=None) -> str:
    """The group's backend: its name when one backend serves every device
    (``"gloo"``), else the device map (``"cpu:gloo,cuda:nccl"``)."""
    pg = _resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    names = {part.split(":")[1] for part in pg.backend_name.split(",")}
    return Backend(names.pop() if len(names) == 1 else pg.backend_name)


def get_process_group_ranks(group) -> List[int]:
    pg = _resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    return pg.ranks


def get_global_rank(group, group_rank: int) -> int:
    if group is None or group is GroupMember.WORLD:
        raise ValueError("group.WORLD does not have local rank to global rank mapping")
    pg = _resolve(group)
    if pg is None or world.groups.get(pg.group_name) is not pg:
        raise ValueError(f"Group {group} is not registered, please create group with distlib.new_group API")
    return pg.global_rank_of(group_rank)


def get_group_rank(group, global_rank: int) -> int:
    if group is None or group is GroupMember.WORLD:
        raise ValueError("group.WORLD does not have local rank to global rank mapping")
    pg = _resolve(group)
    if pg is None or world.groups.get(pg.group_name) is not pg:
        raise ValueError(f"Group {group} is not registered, please create group with distlib.new_group API")
    return pg.group_rank_of(global_rank)


def get_default_group() -> ProcessGroup:
    return _require_init()


def warn_not_in_group(op: str) -> None:
    rank = world.default_pg.rank() if world.default_pg is not None else -1
    warnings.warn(f"Running {op} on global rank {rank} which does not belong to the given group.", stacklevel=3)


__all__ = [
    "init_process_group", "destroy_process_group", "new_group", "is_initialized", "is_available",
    "is_gloo_available", "is_nccl_available", "is_mpi_available", "is_ucc_available", "is_backend_available",
    "is_torchelastic_launched", "get_node_local_rank", "get_rank", "get_world_size", "get_backend",
    "get_process_group_ranks",
    "get_global_rank", "get_group_rank", "default_pg_timeout", "default_pg_nccl_timeout", "DistBackendError",
]
