"""distlib.rendezvous against torch 2.13's behaviour and texts.

Expected texts are torch 2.13.0+cpu's, as docs/torch-rules.md §1-2 lists them; each test names
the call of torch's that it mirrors where there is one (a comment after its name). The
external-store mode (distlib's addition) is tested at the end.
"""

from __future__ import annotations

import re
import socket
from datetime import timedelta

import pytest

from distlib.errors import DistError, DistNetworkError
from distlib.rendezvous import register_rendezvous_handler, rendezvous
from distlib.store.prefix import PrefixStore
from distlib.store.tcp import TCPStore
from distlib.store.tcp.server import StoreServer
from tests.fixtures.ports import free_port

pytestmark = pytest.mark.timeout(60)

ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "USE_LIBUV", "TORCHELASTIC_USE_AGENT_STORE",
            "DISTLIB_EXTERNAL_STORE", "TORCHELASTIC_RUN_ID", "DISTLIB_RUN_ID")
SHORT = timedelta(seconds=10)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def opened():
    """Stores to close after the test (servers of rank-0 stores stop with them)."""
    stores = []
    yield stores
    for store in reversed(stores):
        inner = store
        while isinstance(inner, PrefixStore):
            inner = inner.underlying_store
        inner.close()


def first(url, *args, opened=None, **kwargs):
    gen = rendezvous(url, *args, **kwargs)
    store, rank, world = next(gen)
    if opened is not None:
        opened.append(store)
    return gen, store, rank, world


def env_error(detail: str) -> str:
    return re.escape(f"Error initializing torch.distributed using env:// rendezvous: {detail}")


def tcp_error(detail: str) -> str:
    return re.escape(f"Error initializing torch.distributed using tcp:// rendezvous: {detail}")


def file_error(detail: str) -> str:
    return re.escape(f"Error initializing torch.distributed using file:// rendezvous: {detail}")


# -- the entry point (docs/torch-rules.md §1) ------------------------------------------------------------


def test_unknown_scheme():  # rendezvous('invalid://')
    with pytest.raises(RuntimeError, match=r"^No rendezvous handler for invalid://$"):
        rendezvous("invalid://")


def test_unknown_scheme_after_merging_arguments():
    with pytest.raises(RuntimeError, match=r"^No rendezvous handler for invalid://$"):
        rendezvous("invalid://", 0, 1)


def test_url_must_be_a_string():  # rendezvous(123)
    with pytest.raises(RuntimeError, match=re.escape("`url` must be a string. <class 'int'>: 123")):
        rendezvous(123)


def test_rank_must_be_an_integer():  # rendezvous('env://', rank='0')
    with pytest.raises(RuntimeError, match=r"^`rank` must be an integer\. 0$"):
        rendezvous("env://", rank="0")


def test_world_size_must_be_an_integer():
    with pytest.raises(RuntimeError, match=r"^`world_size` must be an integer\. 1\.5$"):
        rendezvous("env://", world_size=1.5)


def test_node_specific_arguments_already_in_url():  # rendezvous('file://foo?rank=12&world_size=16', 12, 16)
    with pytest.raises(AssertionError, match=re.escape(
            "The url: file://foo?rank=12&world_size=16 has node-specific arguments(rank, world_size) already.")):
        rendezvous("file://foo?rank=12&world_size=16", 12, 16)


def test_node_specific_arguments_mixed():  # tcp://127.0.0.1:1?world_size=1 with rank=0
    with pytest.raises(AssertionError, match=re.escape(
            "The url: tcp://127.0.0.1:1?world_size=1 has node-specific arguments(rank, world_size) already.")):
        rendezvous("tcp://127.0.0.1:1?world_size=1", rank=0)


def test_register_existing_scheme():  # register_rendezvous_handler('env', ...) again
    with pytest.raises(RuntimeError, match=r"^Rendezvous handler for env:// already registered$"):
        register_rendezvous_handler("env", lambda url, **kw: iter(()))


def test_registered_handler_gets_the_merged_url_and_kwargs():
    import sys

    module = sys.modules["distlib.rendezvous"]  # `distlib.rendezvous` may name the function

    seen = []

    def handler(url, **kwargs):
        seen.append((url, kwargs))
        yield ("store", 3, 4)
        raise RuntimeError("again")

    register_rendezvous_handler("testscheme", handler)
    try:
        gen = rendezvous("testscheme://host/path?a=1", 3, 4, timeout=SHORT)
        assert next(gen) == ("store", 3, 4)
        with pytest.raises(RuntimeError, match="again"):
            next(gen)
        assert rendezvous("testscheme://h", rank=2) is not None
        next(rendezvous("testscheme://h", rank=2))
        next(rendezvous("testscheme://h?x=1"))
    finally:
        del module._handlers["testscheme"]
    assert seen[0] == ("testscheme://host/path?a=1&rank=3&world_size=4", {"timeout": SHORT})
    assert seen[1][0] == "testscheme://h?rank=2"  # only what was passed is appended
    assert seen[2][0] == "testscheme://h?x=1"  # both -1: the URL passes untouched


def test_handler_errors_surface_on_first_next():
    gen = rendezvous("tcp://127.0.0.1?rank=0&world_size=1")  # no exception yet: a generator
    with pytest.raises(ValueError, match=tcp_error("port number missing")):
        next(gen)


# -- env:// (docs/torch-rules.md §2) ----------------------------------------------------------------------------


@pytest.mark.parametrize("present, missing", [
    ({}, "RANK"),
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": ""}, "MASTER_PORT"),
    ({"RANK": "", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK"),
])
def test_env_missing_variables_in_order(monkeypatch, present, missing):
    for name, value in present.items():
        monkeypatch.setenv(name, value)
    expected = env_error(f"environment variable {missing} expected, but not set")
    with pytest.raises(ValueError, match="^" + expected + "$"):
        next(rendezvous("env://"))


def test_env_port_out_of_range(monkeypatch):  # env:// with MASTER_PORT=70000
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "70000")
    with pytest.raises(ValueError, match=r"^port must have value from 0 to 65535 but was 70000\.$"):
        next(rendezvous("env://"))


def set_env(monkeypatch, rank="0", world="1", port=None):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    port = free_port() if port is None else port
    monkeypatch.setenv("MASTER_PORT", str(port))
    return port


def test_env_nominal_rank_zero_hosts(monkeypatch, opened):  # env:// with all four
    port = set_env(monkeypatch)
    gen, store, rank, world = first("env://", opened=opened)
    assert (type(store).__name__, rank, world) == ("TCPStore", 0, 1)
    assert (store.host, store.port, store.libuvBackend) == ("127.0.0.1", port, True)
    assert store.timeout == timedelta(minutes=30)
    assert "server=TCPServer" in repr(store)
    store.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(RuntimeError, match=r"^Unable to perform re-rendezvous using env:// method$"):
        next(gen)


def test_env_timeout_is_passed(monkeypatch, opened):  # timeout=timedelta(seconds=7)
    set_env(monkeypatch)
    _, store, _, _ = first("env://", opened=opened, timeout=timedelta(seconds=7))
    assert store.timeout == timedelta(seconds=7)


@pytest.mark.parametrize("url, use_libuv_env, expected", [
    ("env://?use_libuv=0", None, False),
    ("env://", "0", False),
    ("env://?use_libuv=1", "0", True),  # the query wins
    ("env://", "yes", False),  # anything but "1" is legacy
])
def test_env_use_libuv(monkeypatch, opened, url, use_libuv_env, expected):
    set_env(monkeypatch)
    if use_libuv_env is not None:
        monkeypatch.setenv("USE_LIBUV", use_libuv_env)
    _, store, _, _ = first(url, opened=opened)
    assert store.libuvBackend is expected


def test_env_query_overrides_variables(monkeypatch, opened):  # env://?rank=0&world_size=1
    set_env(monkeypatch, rank="5", world="9")
    _, _, rank, world = first("env://?rank=0&world_size=1", opened=opened)
    assert (rank, world) == (0, 1)


def test_env_arguments_instead_of_variables(monkeypatch, opened):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    _, _, rank, world = first("env://", 0, 1, opened=opened)
    assert (rank, world) == (0, 1)


def test_env_client_with_nobody_listening(monkeypatch):  # env:// as rank 1, timeout 1 s
    port = set_env(monkeypatch, rank="1", world="2")
    with pytest.raises(DistNetworkError, match=re.escape(
            f"The client socket has timed out after 1000ms while trying to connect to (127.0.0.1, {port}).")):
        next(rendezvous("env://", timeout=timedelta(seconds=1)))


def test_env_two_ranks_meet(monkeypatch, opened):
    import threading

    port = set_env(monkeypatch, rank="0", world="2")
    result = {}

    def rank1():
        result["r1"] = next(rendezvous(f"tcp://127.0.0.1:{port}?rank=1&world_size=2", timeout=SHORT))

    thread = threading.Thread(target=rank1)
    thread.start()
    _, store0, _, _ = first("env://", opened=opened, timeout=SHORT)
    thread.join(10)
    store1 = result["r1"][0]
    opened.append(store1)
    store1.set("from1", "x")
    assert store0.get("from1") == b"x"


# -- tcp:// (docs/torch-rules.md §2) ---------------------------------------------------------------------------


@pytest.mark.parametrize("url, detail", [
    ("tcp://127.0.0.1?rank=0&world_size=1", "port number missing"),
    ("tcp://127.0.0.1:0?rank=0&world_size=1", "port number missing"),  # `not result.port`
    ("tcp://127.0.0.1:23456?world_size=1", "rank parameter missing"),
    ("tcp://127.0.0.1:23456?rank=0", "world size parameter missing"),
    ("tcp://127.0.0.1:23456", "rank parameter missing"),
])
def test_tcp_missing_parts(url, detail):
    with pytest.raises(ValueError, match="^" + tcp_error(detail) + "$"):
        next(rendezvous(url))


def test_tcp_port_out_of_range():  # tcp://127.0.0.1:99999?rank=0&world_size=1
    with pytest.raises(ValueError, match=r"^Port out of range 0-65535$"):
        next(rendezvous("tcp://127.0.0.1:99999?rank=0&world_size=1"))


@pytest.mark.parametrize("query, error, text", [
    ("rank=x&world_size=1", ValueError, "invalid literal for int() with base 10: 'x'"),
    ("rank&world_size=1", IndexError, "list index out of range"),
    ("rank=%30&world_size=1", ValueError, "invalid literal for int() with base 10: '%30'"),
])
def test_tcp_query_parsing_errors(query, error, text):
    with pytest.raises(error, match="^" + re.escape(text) + "$"):
        next(rendezvous(f"tcp://127.0.0.1:{free_port()}?{query}"))


@pytest.mark.parametrize("query", [
    "rank=0&world_size=1&foo=bar",  # unknown parameter ignored
    "rank=0&world_size=1&world_size=1",  # duplicate: the last wins
    "rank=0=5&world_size=1",  # extra '=': the first value part
    "&&rank=0&&world_size=1&&",  # empty pieces ignored
    "rank=5&world_size=9&rank=0&world_size=1",  # last wins, rank 0
])
def test_tcp_query_parsing_quirks(opened, query):
    _, store, rank, world = first(f"tcp://127.0.0.1:{free_port()}?{query}", opened=opened, timeout=SHORT)
    assert (rank, world) == (0, 1)


def test_tcp_nominal_and_rerendezvous(opened):  # tcp://127.0.0.1:P?rank=0&world_size=1
    port = free_port()
    gen, store, rank, world = first(f"tcp://127.0.0.1:{port}?rank=0&world_size=1", opened=opened)
    assert (store.host, store.port, rank, world, store.libuvBackend) == ("127.0.0.1", port, 0, 1, True)
    assert store.timeout == timedelta(minutes=30)
    with pytest.raises(RuntimeError, match=r"^Unable to perform re-rendezvous using tcp:// method$"):
        next(gen)


def test_tcp_arguments_appended(opened):  # rendezvous('tcp://127.0.0.1:P', rank=0, world_size=1)
    _, _, rank, world = first(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, opened=opened)
    assert (rank, world) == (0, 1)


def test_bytes_url_is_decoded_unlike_torch(opened):
    """A known, benign divergence: torch's type check admits bytes, but its scheme lookup then
    fails ("No rendezvous handler for b'tcp'://"); distlib decodes the URL and goes on."""
    _, store, rank, _ = first(f"tcp://127.0.0.1:{free_port()}?rank=0&world_size=1".encode(), opened=opened)
    assert rank == 0 and type(store).__name__ == "TCPStore"


def test_tcp_ipv6_in_brackets(opened):  # tcp://[::1]:P?rank=0&world_size=1
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    _, store, _, _ = first(f"tcp://[::1]:{free_port()}?rank=0&world_size=1", opened=opened, timeout=SHORT)
    assert store.host == "::1"
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_tcp_host_name_and_legacy_flag(opened):  # tcp://localhost:P?rank=0&world_size=1&use_libuv=0
    _, store, _, _ = first(f"tcp://LocalHost:{free_port()}?rank=0&world_size=1&use_libuv=0", opened=opened,
                           timeout=SHORT)
    assert store.host == "localhost"  # urlparse lower-cases the host name
    assert store.libuvBackend is False


def test_tcp_missing_host_is_an_assertion_as_in_torch():
    with pytest.raises(AssertionError):
        next(rendezvous("tcp://:23456?rank=0&world_size=1"))


def test_tcp_unresolvable_host():  # tcp://dnsnotexist:23456?world_size=2&rank=0, timeout 1 s
    with pytest.raises(DistNetworkError, match=r"client socket has timed out after.*dnsnotexist") as info:
        next(rendezvous("tcp://dnsnotexist:23456?world_size=2&rank=1", timeout=timedelta(seconds=1)))
    assert isinstance(info.value, DistError)


# -- file:// (docs/torch-rules.md §2) ----------------------------------------------------------------------------


@pytest.mark.parametrize("url, detail", [
    ("file://?rank=0&world_size=1", "path missing"),
    ("file:///tmp/x?world_size=1", "rank parameter missing"),
    ("file:///tmp/x?rank=0", "world size parameter missing"),
])
def test_file_missing_parts(url, detail):
    with pytest.raises(ValueError, match="^" + file_error(detail) + "$"):
        next(rendezvous(url))


def test_file_two_ranks_and_rerendezvous(tmp_path, opened):
    path = tmp_path / "store"
    gen0, s0, r0, w0 = first(f"file://{path}?rank=0&world_size=2", opened=opened)
    gen1, s1, r1, w1 = first(f"file://{path}", 1, 2, opened=opened)
    assert (r0, w0, r1, w1) == (0, 2, 1, 2)
    assert type(s0).__name__ == "FileStore" and s0.timeout == timedelta(minutes=5)
    s0.set("a", "1")
    assert s1.get("a") == b"1"
    with pytest.raises(RuntimeError, match=r"^Unable to perform rerendezvous using file:// method$"):
        next(gen0)


def test_file_netloc_is_ignored(tmp_path, opened):  # file://relative/path: the netloc is dropped
    _, store, _, _ = first(f"file://ignored-host{tmp_path}/f?rank=0&world_size=1", opened=opened)
    assert store.path == str(tmp_path / "f")


# -- the external master service (distlib's addition, docs/architecture.md) ------------------------


@pytest.fixture
def service():
    """A running store server standing in for `distlib store-server`; yields (port, raw client)."""
    server = StoreServer("127.0.0.1", 0).start("test-service")
    raw = TCPStore("127.0.0.1", server.port, None, False, SHORT)
    yield server.port, raw
    raw.close()
    server.stop()


def test_agent_store_rank_zero_is_a_client(monkeypatch, opened, service):
    port, raw = service
    set_env(monkeypatch, rank="0", world="2", port=port)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    _, store, rank, world = first("env://", opened=opened, timeout=SHORT)  # returns at once: nobody waited for
    assert (type(store).__name__, rank, world) == ("TCPStore", 0, 2)
    assert "server=<nullptr>" in repr(store)
    store.set("k", "v")
    assert raw.get("k") == b"v"


@pytest.mark.parametrize("run_var", ["TORCHELASTIC_RUN_ID", "DISTLIB_RUN_ID"])
def test_agent_store_with_a_run_id_prefixes_keys(monkeypatch, opened, service, run_var):
    port, raw = service
    set_env(monkeypatch, port=port)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv(run_var, "job-1")
    _, store, _, _ = first("env://", opened=opened, timeout=SHORT)
    assert isinstance(store, PrefixStore) and store.prefix == "distlib/run/job-1"
    store.set("k", "v")
    assert raw.get("distlib/run/job-1/k") == b"v"


def test_torchelastic_run_id_wins_over_distlib_run_id(monkeypatch, opened, service):
    port, _ = service
    set_env(monkeypatch, port=port)
    monkeypatch.setenv("DISTLIB_EXTERNAL_STORE", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "te")
    monkeypatch.setenv("DISTLIB_RUN_ID", "dl")
    _, store, _, _ = first("env://", opened=opened, timeout=SHORT)
    assert store.prefix == "distlib/run/te"


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_distlib_external_store_variable(monkeypatch, opened, service, value):
    port, raw = service
    set_env(monkeypatch, port=port)
    monkeypatch.setenv("DISTLIB_EXTERNAL_STORE", value)
    _, store, _, _ = first("env://", opened=opened, timeout=SHORT)
    assert "server=<nullptr>" in repr(store) and not isinstance(store, PrefixStore)
    store.set("x", "1")
    assert raw.get("x") == b"1"


def test_external_store_query_parameter(opened, service):
    port, raw = service
    _, store, rank, _ = first(f"tcp://127.0.0.1:{port}?rank=0&world_size=3&external_store=1", opened=opened,
                              timeout=SHORT)
    assert rank == 0 and "server=<nullptr>" in repr(store)


def test_two_runs_share_one_service_without_meeting(monkeypatch, opened, service):
    port, raw = service
    set_env(monkeypatch, port=port)
    monkeypatch.setenv("DISTLIB_EXTERNAL_STORE", "1")
    stores = {}
    for run in ("a", "b"):
        monkeypatch.setenv("DISTLIB_RUN_ID", run)
        stores[run] = first("env://", opened=opened, timeout=SHORT)[1]
    stores["a"].set("rank/0", "from a")
    stores["b"].set("rank/0", "from b")
    assert stores["a"].get("rank/0") == b"from a" and stores["b"].get("rank/0") == b"from b"
    assert sorted(raw.list_keys()) == ["distlib/run/a/rank/0", "distlib/run/b/rank/0"]


def test_agent_store_must_be_the_string_true(opened, service):
    """TORCHELASTIC_USE_AGENT_STORE=1 is not "True": rank 0 tries to host on the taken port
    (torch 2.13 does the same: docs/torch-rules.md §2, the TCPStore of env:// and tcp://)."""
    import os

    port, _ = service
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "1"
    try:
        with pytest.raises(DistNetworkError, match="failed to listen on any local network address"):
            next(rendezvous(f"tcp://127.0.0.1:{port}?rank=0&world_size=1", timeout=SHORT))
    finally:
        del os.environ["TORCHELASTIC_USE_AGENT_STORE"]
