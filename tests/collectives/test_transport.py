"""Where ranks listen and what they advertise: DISTLIB_PORT_RANGE, GLOO_SOCKET_IFNAME."""

import socket

import pytest

from distlib.backends.gloo.transport import address

from . import cases, group_cases
from .harness import WorkerPool, spawn


def test_port_range_confines_data_ports(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        low = s.getsockname()[1]
    low = max(20000, min(low, 60000))
    results = spawn(group_cases.port_range_init, 2, str(tmp_path / "s"), low, low + 50)
    ports = []
    for _code, (status, value) in results:
        assert status == "ok", value
        ports.append(value[0])
        assert value[1] == 2.0
    assert all(low <= p <= low + 50 for p in ports) and len(set(ports)) == 2


def test_busy_port_range_names_it(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    [(code, (status, text))] = spawn(group_cases.busy_port_range, 1, str(tmp_path / "s"), port)
    assert status == "ok" and f"DISTLIB_PORT_RANGE={port}-{port}" in text, text


def test_two_interfaces_round_robin(tmp_path):
    results = spawn(group_cases.two_interfaces, 2, str(tmp_path / "s"))
    for _code, (status, value) in results:
        assert status == "ok", value
        meshes, sums = value
        assert meshes == 2 and sums == [1.0, 3.0, 5.0, 7.0]


def test_interface_address_and_errors():
    assert address.interface_address("lo") == "127.0.0.1"
    try:
        address.interface_address("nosuchif0")
    except Exception as exc:  # noqa: BLE001
        assert "nosuchif0" in str(exc) and "lo" in str(exc)
    else:
        raise AssertionError("no error for a missing interface")
    assert address.is_loopback("127.0.1.1") and not address.is_loopback("10.1.2.3")


def test_host_identity_is_stable():
    assert address.host_identity() == address.host_identity()


def test_loopback_address_in_a_multi_host_world_is_warned(caplog):
    """The 127.0.1.1 trap: a rank whose host name resolves to loopback advertises it."""
    from distlib.backends.gloo.group_setup import warn_loopback

    records = [
        {"addresses": [["10.0.0.2", 30001]], "host_id": "a"},
        {"addresses": [["127.0.1.1", 30002]], "host_id": "b"},
    ]
    with caplog.at_level("WARNING", logger="distlib.backends.gloo"):
        warn_loopback("pg0/gloo", records)
    [record] = caplog.records
    text = record.getMessage()
    assert "rank 1 advertises the loopback address 127.0.1.1" in text and "GLOO_SOCKET_IFNAME" in text


def test_early_frame_buffers_are_reused_and_never_handed_out_twice():
    from distlib.backends.gloo.transport.early import MIN_KEPT_BYTES, EarlyBuffers

    size = MIN_KEPT_BYTES
    pool = EarlyBuffers(limit=2 * size)
    a, b, c = pool.take(size), pool.take(size), pool.take(size)
    assert len({id(a), id(b), id(c)}) == 3 and len(a) == size
    for buf in (a, b, c):
        pool.give(buf)
    assert pool.kept == 2 * size  # the third is over the limit: dropped
    again = {id(pool.take(size)), id(pool.take(size))}
    assert again == {id(a), id(b)} and pool.kept == 0
    assert id(pool.take(size)) not in again  # nothing left to reuse: a fresh one
    small = pool.take(1024)
    pool.give(small)
    assert pool.kept == 0  # small frames are not kept
    pool.give(pool.take(size))
    pool.clear()
    assert pool.kept == 0


def test_receive_buffer_is_fixed_only_for_crowded_peers_on_this_machine():
    from distlib.backends.gloo.group_setup import receive_buffers
    from distlib.cpus import usable_cpus
    from distlib.backends.gloo.transport import connection

    assert connection.crowded_receive_buffer(4, 2) == connection.CROWDED_RCVBUF > 0
    assert connection.crowded_receive_buffer(2, 2) == 0 and connection.crowded_receive_buffer(1, 1) == 0
    # one rank per machine: nothing is crowded
    spread = [{"host_id": f"boot{i}/ns/shm"} for i in range(3)]
    assert receive_buffers(spread, "boot0/ns/shm") == [0, 0, 0]
    # more ranks on this kernel (containers included: other namespaces) than CPUs; one elsewhere
    here = [{"host_id": f"boot1/ns{i}/shm{i}"} for i in range(usable_cpus() + 1)]
    crowded = here + [{"host_id": "boot2/ns0/shm0"}]
    assert receive_buffers(crowded, "boot1/ns0/shm0") == [connection.CROWDED_RCVBUF] * len(here) + [0]


def test_ranks_crowded_onto_one_cpu_fix_their_receive_buffers_and_still_reduce_correctly():
    """Two ranks pinned to one CPU: each connection's SO_RCVBUF is the fixed one (the kernel
    reports twice what was set, capped by net.core.rmem_max), and all_reduces of 3 MiB
    (larger than the buffer's share, so sends block until the peer reads) are right."""
    import os

    from distlib.backends.gloo.transport import connection

    with open("/proc/sys/net/core/rmem_max") as f:
        rmem_max = int(f.read())
    expected = 2 * min(connection.CROWDED_RCVBUF, rmem_max)
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(saved)})  # the spawned ranks inherit it
    try:
        pool = WorkerPool(2, env={"DISTLIB_SHM": "0"})
    finally:
        os.sched_setaffinity(0, saved)
    try:
        for buffers, oks in pool.run(cases.crowded_transport, 3 << 18):
            assert buffers == [expected] and oks == [True, True], (buffers, oks)
    finally:
        pool.close()


def test_listening_on_an_address_this_host_lacks_names_it():
    """Any port (no DISTLIB_PORT_RANGE): the bind fails for the address, which the error names
    (it was a TypeError about the missing port range)."""
    from distlib import DistNetworkError

    with pytest.raises(DistNetworkError, match=r"cannot listen on 192\.0\.2\.1 \(errno \d+: .*\): is it an address"):
        address.listen("192.0.2.1", None, 1)  # TEST-NET-1: never an address of this host
