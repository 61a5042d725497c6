"""Process groups: who is in a group, its rank maps, its backends, its ordering — and the
process-wide state (the default group WORLD, the registry of groups, the name counter).

Group names follow torch: "0" for the default group, then "1", "2", ... for each new_group
every rank creates in the same order; the name is what makes the ranks' store keys meet
(``default_pg/<name>//<device>//...``, as torch's own layout, docs/torch-rules.md §3).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Dict, List, Optional

from .backends.base import AnyBackend
from .errors import DistBackendError
from .identity import Identity
from .store.base import Store
from .work import OrderedExecutor


class ProcessGroup:
    """A set of ranks that run collectives together (torch.distributed.ProcessGroup)."""

    #: The GPU init_process_group(device_id=...) or new_group(device_id=...) bound it to.
    bound_device_id: Optional[int] = None

    def __init__(self, name: str, global_ranks: List[int], group_rank: int, store, backend_name: str,
                 backends: Dict[str, AnyBackend], timeout: timedelta):
        self.group_name = name
        self._ranks = list(global_ranks)
        self._rank = group_rank
        self.store = store
        self.backend_name = backend_name
        self.backends = backends
        self.timeout = timeout
        self.executor = OrderedExecutor(f"pg{name}")
        self._global_to_group = {g: i for i, g in enumerate(global_ranks)}
        self.destroyed = False

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self._ranks)

    def name(self) -> str:
        return self.backend_name

    @property
    def ranks(self) -> List[int]:
        return list(self._ranks)

    def group_rank_of(self, global_rank: int) -> int:
        try:
            return self._global_to_group[global_rank]
        except KeyError:
            raise ValueError(
                f"Global rank {global_rank} is not part of group {self.group_name} "
                f"(its ranks are {self._ranks})") from None

    def global_rank_of(self, group_rank: int) -> int:
        if not 0 <= group_rank < len(self._ranks):
            raise ValueError(f"Group rank {group_rank} is out of range for group {self.group_name} "
                             f"of size {len(self._ranks)}")
        return self._ranks[group_rank]

    def backend_for(self, device: str) -> AnyBackend:
        backend = self.backends.get(device)
        if backend is None:
            have = ", ".join(f"{d}:{b.name}" for d, b in self.backends.items()) or "none"
            raise DistBackendError(
                f"process group {self.group_name} has no backend for {device} arrays (it has {have}); "
                f"init it with backend='cpu:gloo,cuda:nccl' to use both")
        return backend

    def _each_backend(self):
        seen = set()
        for backend in self.backends.values():
            if id(backend) not in seen:
                seen.add(id(backend))
                yield backend

    def shutdown(self) -> None:
        """destroy_process_group: each backend releases what it holds, after the operations
        already issued to it have finished (within the group timeout)."""
        if self.destroyed:
            return
        self.destroyed = True
        self.executor.close(DistBackendError(f"process group {self.group_name} was destroyed"))
        for backend in self._each_backend():
            backend.shutdown()

    def abort(self, reason: Optional[str] = None) -> None:
        """_abort_process_group: each backend drops what is pending now (torch's Backend.abort())."""
        if self.destroyed:
            return
        self.destroyed = True
        self.executor.close(DistBackendError(f"process group {self.group_name} was aborted"))
        for backend in self._each_backend():
            backend.abort(reason)

    def __repr__(self) -> str:
        return f"ProcessGroup(name={self.group_name!r}, backend={self.backend_name!r}, ranks={self._ranks})"


class _NonGroupMember:
    """The value new_group returns on ranks that are not in the group."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


NON_GROUP_MEMBER = _NonGroupMember()


class _World:
    """Everything init_process_group creates and destroy_process_group removes: each field is
    declared here, and ``reset`` puts every one back (a process may init again)."""

    #: The default group (WORLD), None before init_process_group and after destroy.
    default_pg: Optional[ProcessGroup]
    #: The default group's store (``default_pg/`` over the rendezvous's); None with mpi.
    default_store: Optional[Store]
    #: Whether init_process_group made ``default_store`` (a rendezvous), so destroy closes it;
    #: a store the caller passed is the caller's.
    owns_store: bool
    #: Every live group by name, the default one included.
    groups: Dict[str, ProcessGroup]
    #: The next group name (torch's counter: every rank creates groups in the same order).
    group_count: int
    #: device -> backend name of the default group (new_group's default).
    backend_config: Dict[str, str]
    #: The init method the default group was made with (None: a store was passed).
    init_method: Optional[str]
    #: Who this process is (identity.py), as init_process_group read it, with the group's rank
    #: and size.
    identity: Optional[Identity]

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        self.default_pg = None
        self.default_store = None
        self.owns_store = False
        self.groups = {}
        self.group_count = 0
        self.backend_config = {}
        self.init_method = None
        self.identity = None


world = _World()


class _GroupMemberMeta(type):
    @property
    def WORLD(cls) -> Optional[ProcessGroup]:  # noqa: N802 - torch's name
        return world.default_pg


class GroupMember(metaclass=_GroupMemberMeta):
    """``GroupMember.WORLD`` (the default group) and ``GroupMember.NON_GROUP_MEMBER``."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER
