"""collectives.py goes by the kind a backend declares (backends/base.py), not by probing it:
a stream-ordered plugin's Work comes back as is, a sync call waits on it, barrier gets
device_ids, isend is the backend's send; a host-synchronous plugin runs in the group's order."""

from datetime import timedelta

import numpy as np
import pytest

import distlib as dist
from distlib.backends import base
from distlib.work import HostWork, Work


class _Done(HostWork):
    """A stream-ordered operation that the device has already run; records who waited (a
    plugin's Work implements the Work protocol, here through HostWork)."""

    def __init__(self, op_name, log):
        super().__init__(op_name)
        self.finish()
        self.log = log

    def wait(self, timeout=None):
        self.log.append(("wait", self.op_name))
        return True


class StreamPlugin(base.StreamOrderedBackend):
    name = "streamplugin"

    def __init__(self, store, rank, size, timeout):
        super().__init__(store, rank, size, timeout)
        self.log = []

    def all_reduce(self, array, op):
        self.log.append(("all_reduce", op))
        array *= self.size
        return _Done("all_reduce", self.log)

    def barrier(self, device_ids=None):
        self.log.append(("barrier", device_ids))
        return _Done("barrier", self.log)

    def send(self, array, dst, tag):
        self.log.append(("send", dst, tag))
        return _Done("send", self.log)


class HostPlugin(dist.CommBackend):
    name = "hostplugin"

    def all_reduce(self, array, op):
        array += 1
        return "ignored: a host-synchronous method's value is not the caller's"


@pytest.fixture
def group():
    made = []

    def make(cls, world_size=1):
        name = cls.name
        dist.Backend.register_backend(name, lambda store, rank, size, timeout: made.append(
            cls(store, rank, size, timeout)) or made[-1], devices=["cpu"])
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=world_size,
                                timeout=timedelta(seconds=5))
        return made[-1]

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_kinds_are_declared():
    assert dist.CommBackend.kind is base.HOST_SYNCHRONOUS
    assert dist.StreamOrderedBackend.kind is base.STREAM_ORDERED
    from distlib.backends.gloo.backend import GlooBackend
    from distlib.backends.nccl.backend import NcclBackend

    assert GlooBackend.kind is base.HOST_SYNCHRONOUS and NcclBackend.kind is base.STREAM_ORDERED


def test_a_stream_ordered_backend_returns_its_work_and_a_sync_call_waits_on_it(group):
    backend = group(StreamPlugin)
    x = np.ones(3, np.float32)
    assert dist.all_reduce(x) is None and x.tolist() == [1.0] * 3
    assert backend.log == [("all_reduce", dist.ReduceOp.SUM), ("wait", "all_reduce")]
    backend.log.clear()
    work = dist.all_reduce(x, async_op=True)
    assert isinstance(work, _Done) and backend.log == [("all_reduce", dist.ReduceOp.SUM)]
    backend.log.clear()
    dist.barrier(device_ids=[0])
    assert backend.log == [("barrier", [0]), ("wait", "barrier")]


def test_isend_on_a_stream_ordered_backend_is_its_send(group):
    backend = group(StreamPlugin, world_size=2)
    work = dist.isend(np.ones(1), dst=1, tag=7)
    assert isinstance(work, _Done) and backend.log == [("send", 1, 7)]


def test_a_host_synchronous_backend_runs_in_the_groups_order(group):
    group(HostPlugin)
    x = np.zeros(2)
    assert dist.all_reduce(x) is None and x.tolist() == [1.0, 1.0]
    work = dist.all_reduce(x, async_op=True)
    assert work.wait() and x.tolist() == [2.0, 2.0] and work.result() == [x]
    assert isinstance(work, Work) and isinstance(work, HostWork)  # the host's implementation of the protocol


def test_a_creator_must_return_one_of_the_kinds():
    dist.Backend.register_backend("notabackend", lambda store, rank, size, timeout: object(), devices=["cpu"])
    with pytest.raises(TypeError, match="not a distlib.CommBackend \\(or distlib.StreamOrderedBackend\\)"):
        dist.init_process_group("notabackend", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


class _NeitherKind(base.BackendBase):
    """Derives from the shared base only: it declares no kind and has no collective."""

    name = "neitherkind"


def test_a_creator_returning_the_shared_base_alone_is_refused_too():
    dist.Backend.register_backend("neitherkind", lambda store, rank, size, timeout: _NeitherKind(store, rank, size,
                                  timeout), devices=["cpu"])
    with pytest.raises(TypeError, match="returned _NeitherKind, not a distlib.CommBackend"):
        dist.init_process_group("neitherkind", store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()
