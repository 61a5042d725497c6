"""The fake device itself (fake_cuda.py): what it promises the nccl tests — work runs later,
in order; abort discards what is pending; unsafe use of a communicator is caught."""

import threading
import time

import numpy as np
import pytest

from distlib.testing.fake_gpu import cuda as F


@pytest.fixture
def fake():
    F._config.update(dir=None, delays={}, enqueue_s=0.0, on_violation="record")
    F.violations.clear()
    yield F
    F._config.update(delays={}, enqueue_s=0.0)
    F.violations.clear()


def _comm():
    return F.nccl.NcclCommunicator(1, F.nccl.get_unique_id(), 0)


def test_work_runs_later_in_order_and_events_say_when(fake):
    x = F.asarray(np.arange(4, dtype=np.float32))
    release = F.hold()
    comm = _comm()
    comm.allReduce(x.data.ptr, x.data.ptr, 4, 7, 0, 1)
    x *= 2.0
    event = F.Stream().record()
    time.sleep(0.05)
    assert not event.done  # held: nothing has run
    release.set()
    event.synchronize()
    assert event.done and x.get().tolist() == [0.0, 2.0, 4.0, 6.0]
    comm.destroy()
    assert fake.violations == []


def test_abort_discards_a_held_back_operation(fake):
    fake._config["delays"] = {1: 5.0}
    x = F.asarray(np.ones(2, np.float32))
    y = F.zeros(2, np.float32)
    comm = _comm()
    comm.allReduce(x.data.ptr, y.data.ptr, 2, 7, 0, 1)
    event = F.Stream().record()
    comm.abort()
    event.synchronize()  # an aborted kernel's event completes too
    assert y.get().tolist() == [0.0, 0.0]
    comm.abort()  # cupy: a second abort does nothing
    with pytest.raises(F.nccl.NcclError):
        comm.allReduce(x.data.ptr, y.data.ptr, 2, 7, 0, 1)
    assert len(fake.violations) == 1 and "allReduce() on a communicator after its abort" in fake.violations[0]


def test_abort_while_another_thread_enqueues_is_caught(fake):
    fake._config["enqueue_s"] = 0.3
    x = F.asarray(np.ones(2, np.float32))
    comm = _comm()
    inside = threading.Thread(target=comm.allReduce, args=(x.data.ptr, x.data.ptr, 2, 7, 0, 1))
    inside.start()
    time.sleep(0.1)
    comm.abort()
    inside.join()
    assert any("abort() while another thread is inside allReduce()" in v for v in fake.violations), fake.violations


def test_polling_for_errors_beside_an_enqueue_is_allowed(fake):
    fake._config["enqueue_s"] = 0.2
    x = F.asarray(np.ones(2, np.float32))
    comm = _comm()
    inside = threading.Thread(target=comm.allReduce, args=(x.data.ptr, x.data.ptr, 2, 7, 0, 1))
    inside.start()
    time.sleep(0.05)
    comm.check_async_error()
    inside.join()
    comm.destroy()
    assert fake.violations == []
