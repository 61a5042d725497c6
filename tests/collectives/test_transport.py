"""Where ranks listen and what they advertise: DISTLIB_PORT_RANGE, GLOO_SOCKET_IFNAME."""

import socket

from distlib.transport import address

from . import group_cases
from .harness import spawn


def test_port_range_confines_data_ports(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        low = s.getsockname()[1]
    low = max(20000, min(low, 60000))
    results = spawn(group_cases.port_range_init, 2, str(tmp_path / "s"), low, low + 50)
    ports = []
    for code, (status, value) in results:
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
    for code, (status, value) in results:
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
    from distlib.backends.gloo import GlooBackend

    records = [
        {"addresses": [["10.0.0.2", 30001]], "host_id": "a"},
        {"addresses": [["127.0.1.1", 30002]], "host_id": "b"},
    ]
    backend = GlooBackend.__new__(GlooBackend)
    backend.label = "pg0/gloo"
    with caplog.at_level("WARNING", logger="distlib.backends.gloo"):
        backend._warn_loopback(records)
    [record] = caplog.records
    text = record.getMessage()
    assert "rank 1 advertises the loopback address 127.0.1.1" in text and "GLOO_SOCKET_IFNAME" in text
