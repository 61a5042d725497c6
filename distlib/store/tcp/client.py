"""``TCPStore``: torch's TCPStore client (and, with ``is_master=True``, its server), in Python.

Speaks the c10d wire protocol (protocol.py) to a torch 2.x server or a distlib server; a torch
client works against a distlib server. Constructor, methods, return types and exceptions are
torch's (``TCPStore(host_name, port, world_size=None, is_master=False,
timeout=timedelta(seconds=300), wait_for_workers=True, multi_tenant=False,
master_listen_fd=None, use_libuv=True)``).

What it does beyond torch, and why:

* Against a distlib server, ``get`` and ``multi_get`` take one round trip instead of
  torch's two (WAIT and GET pipelined; see protocol.py, "ordered-wait capability"). Against a
  torch server it behaves exactly as torch's client, including coping with the libuv
  server's spurious wake-ups (an empty value after a wake is re-checked).
* Connecting retries with backoff until the timeout and then fails naming host:port and
  what went wrong (connect.py). Every reply is read with a deadline: a server that stops
  answering is reported, naming the operation and the server, instead of hanging.
* The master waits for its workers on a condition the in-process server signals, not by
  polling every 10 ms; its timeout error lists where the workers that did join came from.
* A zero timeout means "do not wait", as torch's TCPStore reads it.
* Every error names the server (host:port).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence

from ...deadline import Deadline, TimeoutLike, as_seconds, format_duration
from ...errors import DistNetworkError, DistStoreError, QueueEmptyError
from ..base import Store, ValueLike, check_key, check_keys, to_bytes
from . import protocol as proto
from .connect import connect, describe_socket, format_endpoint
from .protocol import (
    I64,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    NOT_READY,
    ORDERED_WAIT_PROBE_KEY,
    READY,
    STOP_WAITING,
    U32,
    U64,
    WAIT_CANCELED,
    WORKER_COUNTER_KEY,
    Op,
)
from .server import StoreServer, bind_listener

log = logging.getLogger("distlib.store.tcp.client")

_CLOSED_TEXT = ("Failed to recv, got 0 bytes. Connection was likely closed. "
                "Did the remote server shutdown or crash?")

#: Replies to requests that do not wait (SET, ADD, GET after its WAIT, ...) come at once from a
#: healthy server; one that has not answered after max(store timeout, this) is reported dead.
MIN_REPLY_DEADLINE = 30.0

#: How long a client polls for a reply before blocking (adaptive, see _spin_for_reply).
#: DISTLIB_STORE_CLIENT_SPIN_US=0 turns it off.
SPIN_S = float(os.environ.get("DISTLIB_STORE_CLIENT_SPIN_US", "100")) / 1e6

_WAIT = Op.WAIT
_u64 = U64.unpack_from
_i64 = I64.unpack_from


class _NotAStoreServer(DistNetworkError):
    """The peer answered the handshake wrongly: retrying will not help."""


class _WaitTimedOut(Exception):
    """Internal: the reply to a WAIT did not come within the wait's timeout."""


# -- servers owned by TCPStore objects in this process ---------------------------------------


class _ServerHandle:
    """A running in-process server and how many TCPStore objects own it.

    torch's ``multi_tenant=True`` shares one server per port within a process; the server
    stops when the last TCPStore that owns it is gone.
    """

    def __init__(self, server: StoreServer, multi_tenant: bool):
        self.server = server
        self.multi_tenant = multi_tenant
        self.owners = 0
        self.lock = threading.Lock()

    def acquire(self) -> None:
        with self.lock:
            self.owners += 1

    def release(self) -> None:
        with self.lock:
            self.owners -= 1
            last = self.owners == 0
        if last:
            with _TENANTS_LOCK:
                if _TENANTS.get(self.server.port) is self:
                    del _TENANTS[self.server.port]
            self.server.stop()


_TENANTS: Dict[int, _ServerHandle] = {}
_TENANTS_LOCK = threading.Lock()


def _agent_store_tolerates_bind_failure(port: int) -> bool:
    """torch's rule: a master whose bind fails becomes a plain client when
    TORCHELASTIC_USE_AGENT_STORE is truthy and MASTER_PORT names this port."""
    flag = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower()
    return flag in ("1", "true", "yes") and os.environ.get("MASTER_PORT", "").strip() == str(port)


def _start_server(port: int, multi_tenant: bool, master_listen_fd: Optional[int]) -> Optional[_ServerHandle]:
    if multi_tenant and port != 0:
        with _TENANTS_LOCK:
            handle = _TENANTS.get(port)
            if handle is not None and handle.server.running:
                handle.acquire()
                return handle
    if master_listen_fd is not None:
        sock = socket.socket(fileno=int(master_listen_fd))
        bound = sock.getsockname()[1]
        if port and bound != port:
            raise DistNetworkError(f"master_listen_fd {master_listen_fd} is bound to port {bound}, not to port {port}")
        sock.listen(4096)
    else:
        try:
            sock = bind_listener("", port)
        except DistNetworkError:
            if _agent_store_tolerates_bind_failure(port):
                log.info("port %d is taken and TORCHELASTIC_USE_AGENT_STORE is set: using the server already there", port)
                return None
            raise
    handle = _ServerHandle(StoreServer(listen_sock=sock).start(f"distlib-store-server:{sock.getsockname()[1]}"), multi_tenant)
    handle.acquire()
    if multi_tenant:
        with _TENANTS_LOCK:
            _TENANTS[handle.server.port] = handle
    return handle


def _close_socket(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


# -- the client --------------------------------------------------------------------------------


class TCPStore(Store):
    """A store served over TCP by a master (torch.distributed.TCPStore)."""

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: Optional[int] = None,
        is_master: bool = False,
        timeout: TimeoutLike = timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: Optional[int] = None,
        use_libuv: bool = True,
    ):
        super().__init__(timeout)
        if not isinstance(host_name, str) or not host_name:
            raise ValueError(f"TCPStore host_name must be a non-empty str, got {host_name!r}")
        port = int(port)
        if not 0 <= port <= 65535:
            raise ValueError(f"port must have value from 0 to 65535 but was {port}.")
        if world_size is not None:
            world_size = int(world_size)
            if world_size == 0:
                raise ValueError("TCPStore world size cannot be 0")
        self._host = host_name
        self._use_libuv = bool(use_libuv)
        self._world_size = world_size
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._rbuf = bytearray()
        self._broken: Optional[str] = None
        self._spin_misses = 0
        self._spin_skip = 0
        self._ordered = False
        self._server: Optional[_ServerHandle] = None
        self._server_finalizer: Optional[weakref.finalize] = None
        deadline = Deadline(self._timeout_s)

        if is_master:
            self._server = _start_server(port, multi_tenant, master_listen_fd)
            if self._server is not None:
                port = self._server.server.port
                self._server_finalizer = weakref.finalize(self, self._server.release)
        self._port = port
        self._connect(deadline)
        self._finalizer = weakref.finalize(self, _close_socket, self._sock)

        if world_size is not None and wait_for_workers:
            with self._lock:
                self._send(proto.add(WORKER_COUNTER_KEY, 1))
                joined = self._read_i64("ADD init/")
            if self._server is not None:
                self._wait_for_workers(world_size, joined, deadline)

    # -- properties ------------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def libuvBackend(self) -> bool:  # noqa: N802 - torch's name
        return self._use_libuv

    @property
    def ordered_waits(self) -> bool:
        """True when the server is a distlib server (one-round-trip get)."""
        return self._ordered

    def describe(self) -> str:
        return f"TCPStore server {format_endpoint(self._host, self._port)}"

    def __repr__(self) -> str:
        server = f"TCPServer(port={self._server.server.port})" if self._server is not None else "<nullptr>"
        return f"TCPStore(client=TCPClient(SocketImpl({describe_socket(self._sock)})), server={server})"

    # -- connection ------------------------------------------------------------------------------

    def _connect(self, deadline: Deadline) -> None:
        """Connect and handshake, retrying a failed handshake too, until the deadline."""
        last: Optional[Exception] = None
        while True:
            sock = connect(self._host, self._port, deadline)
            try:
                self._handshake(sock, deadline)
                return
            except _NotAStoreServer:
                _close_socket(sock)
                raise
            except (OSError, DistNetworkError) as exc:
                _close_socket(sock)
                last = exc
                if deadline.expired():
                    raise DistNetworkError(
                        f"The client socket has timed out after {int(deadline.seconds * 1000)}ms while trying "
                        f"to connect to ({self._host}, {self._port}): connected, but the handshake failed: {exc}"
                    ) from last
                time.sleep(min(0.05, deadline.remaining()))

    def _handshake(self, sock: socket.socket, deadline: Deadline) -> None:
        nonce = os.getpid() & 0xFFFFFFFF
        sock.settimeout(max(0.001, deadline.remaining()))
        sock.sendall(proto.validate() + proto.ping(nonce) + proto.keys_request(Op.CHECK, [ORDERED_WAIT_PROBE_KEY]))
        reply = b""
        while len(reply) < 5:
            chunk = sock.recv(5 - len(reply))
            if not chunk:
                raise DistNetworkError(f"{_CLOSED_TEXT} (during the handshake with {self.describe()})")
            reply += chunk
        echoed = U32.unpack_from(reply)[0]
        if echoed != nonce:
            raise _NotAStoreServer(
                f"Ping failed, invalid value returned from server. Expected: {nonce}, Got: {echoed} "
                f"({format_endpoint(self._host, self._port)} answered, but not as a TCPStore server: "
                f"is this the right port?)")
        self._ordered = reply[4] == READY
        sock.settimeout(None)
        self._sock = sock
        self._rbuf = bytearray()
        self._broken = None

    def _wait_for_workers(self, world_size: int, joined: int, deadline: Deadline) -> None:
        server = self._server.server
        server.wait_for_workers(world_size, deadline)
        if server.workers_joined >= world_size:
            return
        peers = ", ".join(server.worker_peers) or "nobody"
        raise DistStoreError(
            f"Timed out after {int(round(deadline.elapsed()))} seconds waiting for clients. "
            f"{server.workers_joined}/{world_size} clients joined. "
            f"(TCPStore master on port {self._port}; joined from: {peers}. The missing clients never "
            f"connected: check that they were started with this host and port and can reach it.)"
        )

    def close(self) -> None:
        """Close this client's connection (and stop the server if this object owns it last)."""
        with self._lock:
            self._broken = self._broken or f"this TCPStore ({self.describe()}) was closed"
            self._finalizer()
            if self._server_finalizer is not None:
                self._server_finalizer()

    # -- I/O helpers -----------------------------------------------------------------------------

    def _fail(self, text: str) -> DistNetworkError:
        self._broken = text
        return DistNetworkError(text)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise DistNetworkError(self._broken)

    def _send(self, data: bytes) -> None:
        self._check_usable()
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise self._fail(f"Failed to send to {self.describe()}: {exc.strerror or exc}") from exc

    def _recv(self, what: str, timeout: Optional[float]) -> None:
        """Append at least one byte to the read buffer; _WaitTimedOut after ``timeout``."""
        sock = self._sock
        if self._spin_skip:
            self._spin_skip -= 1
        elif SPIN_S and self._spin_for_reply(what, timeout is None):
            return
        limit = max(self._timeout_s, MIN_REPLY_DEADLINE) if timeout is None else timeout
        sock.settimeout(limit if limit > 0 else 0.0)
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, BlockingIOError):
            if timeout is not None:
                raise _WaitTimedOut() from None
            raise self._fail(
                f"{self.describe()} did not answer {what} within {format_duration(limit)} "
                f"(the store timeout); the connection is no longer usable") from None
        except OSError as exc:
            raise self._fail(f"Failed to recv from {self.describe()} during {what}: {exc.strerror or exc}") from exc
        if not chunk:
            raise self._fail(f"{_CLOSED_TEXT} ({self.describe()}, during {what})")
        self._rbuf += chunk

    def _spin_for_reply(self, what: str, count_miss: bool) -> bool:
        """Poll the socket without sleeping for up to SPIN_S; True if a reply arrived.

        Why: on a VM whose idle vCPUs halt, a blocking recv costs a ~100 us wake-up per round
        trip; a reply from a healthy server on the same host or LAN arrives well within the
        window. When replies keep missing the window (an overloaded server, many clients on
        few cores), spinning only burns CPU the server needs, so the client backs off
        exponentially and stops spinning for up to 1024 requests.
        """
        sock = self._sock
        sock.setblocking(False)
        recv = sock.recv
        clock = time.perf_counter
        until = clock() + SPIN_S
        while True:
            try:
                chunk = recv(65536)
            except BlockingIOError:
                if clock() < until:
                    continue
                if count_miss:
                    self._spin_misses += 1
                    self._spin_skip = min(1024, 1 << self._spin_misses)
                return False
            except OSError as exc:
                raise self._fail(f"Failed to recv from {self.describe()} during {what}: {exc.strerror or exc}") from exc
            if not chunk:
                raise self._fail(f"{_CLOSED_TEXT} ({self.describe()}, during {what})")
            self._rbuf += chunk
            self._spin_misses = 0
            return True

    def _read(self, n: int, what: str, timeout: Optional[float] = None) -> bytes:
        buf = self._rbuf
        while len(buf) < n:
            self._recv(what, timeout)
            timeout = None  # once the reply has started, the rest follows at once
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def _read_u8(self, what: str, timeout: Optional[float] = None) -> int:
        buf = self._rbuf
        if not buf:
            self._recv(what, timeout)
        value = buf[0]
        del buf[:1]
        return value

    def _read_i64(self, what: str) -> int:
        buf = self._rbuf
        while len(buf) < 8:
            self._recv(what, None)
        value = _i64(buf)[0]
        del buf[:8]
        return value

    def _read_blob(self, what: str) -> bytes:
        buf = self._rbuf
        while len(buf) < 8:
            self._recv(what, None)
        n = _u64(buf)[0]
        while len(buf) < 8 + n:
            self._recv(what, None)
        value = bytes(buf[8 : 8 + n])
        del buf[: 8 + n]
        return value

    def _await_wait(self, seconds: float, what: str, held_reply: Optional[Callable[[], object]] = None):
        """Read the deferred STOP_WAITING of a WAIT/BARRIER sent with a ``seconds`` limit.

        Returns ``(True, held)`` when the wait completed (``held`` = the reply of the request
        pipelined behind it, if any) and ``(False, None)`` when it timed out and was cancelled.
        On timeout it sends CANCEL_WAIT and reads torch's two-byte race: ``01`` (cancelled),
        or ``00 01`` (the wait completed just before the cancel arrived; then it counts as
        completed). Against a distlib server, the pipelined request's reply comes between.
        """
        try:
            code = self._read_u8(what, seconds)
        except _WaitTimedOut:
            self._send(proto.no_body(Op.CANCEL_WAIT))
            code = self._read_u8(f"CANCEL_WAIT after {what}")
            if code == STOP_WAITING:
                held = held_reply() if held_reply else None
                if self._read_u8(f"CANCEL_WAIT after {what}") != WAIT_CANCELED:
                    raise self._fail("wait_canceled response is expected")
                return True, held
            if code != WAIT_CANCELED:
                raise self._fail(f"wait_canceled response is expected (got {code})")
            if held_reply:
                held_reply()
            return False, None
        if code != STOP_WAITING:
            raise self._fail(f"Stop_waiting response is expected (got {code})")
        return True, held_reply() if held_reply else None

    # -- keys ------------------------------------------------------------------------------------

    @staticmethod
    def _wire(key: str) -> bytes:
        data = ("/" + check_key(key)).encode("utf-8")
        if len(data) > MAX_KEY_BYTES:
            raise ValueError(f"TCPStore key of {len(data)} bytes exceeds the limit of {MAX_KEY_BYTES} bytes")
        return data

    @classmethod
    def _wires(cls, keys: Sequence[str]) -> List[bytes]:
        return [cls._wire(k) for k in check_keys(keys)]

    @staticmethod
    def _value(value: ValueLike, what: str = "value") -> bytes:
        data = to_bytes(value, what)
        if len(data) > MAX_VALUE_BYTES:
            raise ValueError(f"TCPStore {what} of {len(data)} bytes exceeds the limit of {MAX_VALUE_BYTES} bytes")
        return data

    def _timeout_error(self, wire_keys: Sequence[bytes], seconds: float) -> DistStoreError:
        shown = [k.decode("utf-8", "replace") for k in wire_keys]
        return self.wait_timeout_error(shown, seconds, "the keys were never set")

    # -- the Store API ---------------------------------------------------------------------------

    def set(self, key: str, value: ValueLike) -> None:
        data = proto.set_(self._wire(key), self._value(value))
        with self._lock:
            self._send(data)

    def get(self, key: str) -> bytes:
        wire = self._wire(key)
        seconds = self._timeout_s
        with self._lock:
            if self._ordered:
                self._send(proto.keys_request(_WAIT, [wire]) + proto.get(wire))
                done, value = self._await_wait(seconds, "GET", lambda: self._read_blob("GET"))
                if not done:
                    raise self._timeout_error([wire], seconds)
                return value
            return self._get_from_torch_server(wire, seconds)

    def _get_from_torch_server(self, wire: bytes, seconds: float) -> bytes:
        """torch's sequence: WAIT, then GET. A libuv server may wake a WAIT although the key
        does not exist (a compare_set that changed nothing); an empty value is re-checked."""
        deadline = Deadline(seconds)
        while True:
            self._send(proto.keys_request(_WAIT, [wire]))
            done, _ = self._await_wait(deadline.remaining(), "WAIT")
            if not done:
                raise self._timeout_error([wire], seconds)
            self._send(proto.get(wire))
            value = self._read_blob("GET")
            if value:
                return value
            self._send(proto.keys_request(Op.CHECK, [wire]))
            if self._read_u8("CHECK") == READY:
                return value

    def add(self, key: str, amount: int) -> int:
        data = proto.add(self._wire(key), int(amount))
        with self._lock:
            self._send(data)
            return self._read_i64("ADD")

    def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        data = proto.compare_set(self._wire(key), self._value(expected_value, "expected_value"),
                                 self._value(desired_value, "desired_value"))
        with self._lock:
            self._send(data)
            return self._read_blob("COMPARE_SET")

    def check(self, keys: List[str]) -> bool:
        data = proto.keys_request(Op.CHECK, self._wires(keys))
        with self._lock:
            self._send(data)
            return self._read_u8("CHECK") == READY

    def wait(self, keys: List[str], timeout: Optional[TimeoutLike] = None) -> None:
        wires = self._wires(keys)
        seconds = self._wait_seconds(timeout)
        with self._lock:
            self._send(proto.keys_request(_WAIT, wires))
            done, _ = self._await_wait(seconds, "WAIT")
        if not done:
            raise self._timeout_error(wires, seconds)

    def delete_key(self, key: str) -> bool:
        data = proto.key_request(Op.DELETE_KEY, self._wire(key))
        with self._lock:
            self._send(data)
            return self._read_i64("DELETE_KEY") == 1

    def num_keys(self) -> int:
        with self._lock:
            self._send(proto.no_body(Op.GETNUMKEYS))
            return self._read_i64("GETNUMKEYS")

    def has_extended_api(self) -> bool:
        return True

    def append(self, key: str, value: ValueLike) -> None:
        data = proto.key_value_request(Op.APPEND, self._wire(key), self._value(value))
        with self._lock:
            self._send(data)

    def multi_get(self, keys: List[str]) -> List[bytes]:
        wires = self._wires(keys)
        seconds = self._timeout_s

        def read_values() -> List[bytes]:
            return [self._read_blob("MULTI_GET") for _ in wires]

        with self._lock:
            if self._ordered:
                self._send(proto.keys_request(_WAIT, wires) + proto.keys_request(Op.MULTI_GET, wires))
                done, values = self._await_wait(seconds, "MULTI_GET", read_values)
                if not done:
                    raise self._timeout_error(wires, seconds)
                return values
            self._send(proto.keys_request(_WAIT, wires))
            done, _ = self._await_wait(seconds, "WAIT")
            if not done:
                raise self._timeout_error(wires, seconds)
            self._send(proto.keys_request(Op.MULTI_GET, wires))
            return read_values()

    def multi_set(self, keys: List[str], values: List[ValueLike]) -> None:
        wires = self._wires(keys)
        values = list(values)
        if len(wires) != len(values):
            raise DistStoreError(
                f"multiSet keys and values vectors must be of same size ({len(wires)} keys, {len(values)} values)")
        data = proto.multi_set(wires, [self._value(v) for v in values])
        with self._lock:
            self._send(data)

    def _require_queues(self) -> None:
        if not self._use_libuv:
            raise NotImplementedError("queues not implemented on legacy TCPStore backend")

    def queue_push(self, key: str, value: ValueLike) -> None:
        self._require_queues()
        data = proto.key_value_request(Op.QUEUE_PUSH, self._wire(key), self._value(value))
        with self._lock:
            self._send(data)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        self._require_queues()
        wire = self._wire(key)
        with self._lock:
            if block:
                self._send(proto.keys_request(_WAIT, [wire]))
                done, _ = self._await_wait(self._timeout_s, "WAIT")
                if not done:
                    raise self._timeout_error([wire], self._timeout_s)
            self._send(proto.key_request(Op.QUEUE_POP, wire))
            length = self._read_i64("QUEUE_POP")
            if length <= 0:
                raise QueueEmptyError("queue is empty")
            return self._read_blob("QUEUE_POP")

    def queue_len(self, key: str) -> int:
        self._require_queues()
        data = proto.key_request(Op.QUEUE_LEN, self._wire(key))
        with self._lock:
            self._send(data)
            return self._read_i64("QUEUE_LEN")

    def list_keys(self) -> List[str]:
        """User keys (those a torch client wrote with its leading slash), slash removed."""
        with self._lock:
            self._send(proto.no_body(Op.LIST_KEYS))
            count = self._read_i64("LIST_KEYS")
            raw = [self._read_blob("LIST_KEYS") for _ in range(count)]
        return [k[1:].decode("utf-8", "replace") for k in raw if k.startswith(b"/")]

    def barrier(self, key: str, world_size: int, timeout: Optional[TimeoutLike] = None) -> None:
        """The server-side BARRIER: returns when ``world_size`` callers have arrived."""
        seconds = self._wait_seconds(timeout)
        data = proto.barrier(self._wire(key), int(world_size))
        with self._lock:
            self._send(data)
            done, _ = self._await_wait(seconds, "BARRIER")
        if not done:
            raise DistStoreError(
                f"barrier timeout after {int(seconds * 1000)}ms, key: {key} "
                f"(waited {format_duration(seconds)} on {self.describe()} for {world_size} participants)")

    def ping(self) -> float:
        """Round trip of a PING, in seconds (a health check)."""
        nonce = os.getpid() & 0xFFFFFFFF
        deadline = Deadline(self._timeout_s)
        with self._lock:
            self._send(proto.ping(nonce))
            echoed = U32.unpack(self._read(4, "PING"))[0]
        if echoed != nonce:
            raise self._fail(f"Ping failed, invalid value returned from server. Expected: {nonce}, Got: {echoed}")
        return deadline.elapsed()

    def clone(self) -> "TCPStore":
        """A new connection to the same server (no worker counting), as torch's clone()."""
        return TCPStore(self._host, self._port, None, False, timedelta(seconds=self._timeout_s),
                        use_libuv=self._use_libuv)
