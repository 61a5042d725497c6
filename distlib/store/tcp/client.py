"""``TCPStore``: torch's TCPStore client (and, with ``is_master=True``, its server), in Python.

Speaks the c10d wire protocol (codec.py, docs/wire-protocol.md) to a torch 2.x server or a
distlib server; a torch client works against a distlib server. Constructor, methods, return
types and exceptions are torch's (``TCPStore(host_name, port, world_size=None,
is_master=False, timeout=timedelta(seconds=300), wait_for_workers=True, multi_tenant=False,
master_listen_fd=None, use_libuv=True)``), plus one keyword of distlib's own, ``security``
(the token and TLS settings; by default the environment's, docs/security.md).

What it does beyond torch, and why:

* Against a distlib server, ``get`` and ``multi_get`` take one round trip instead of
  torch's two (WAIT and GET pipelined; see codec.py, "ordered-wait capability"). Against a
  torch server it behaves exactly as torch's client, including coping with the libuv
  server's spurious wake-ups (an empty value after a wake is re-checked).
* **Same-host transport.** When ``host_name`` is a loopback address and a distlib server of
  this user listens on that port on this host, the client connects to the server's abstract
  UNIX socket (``distlib.net.unix_socket_name``) instead of TCP: the same bytes, the same
  server, about a third of the kernel's cost per request. torch servers have no such
  socket, so against them nothing changes. ``DISTLIB_STORE_UNIX=0`` turns it off;
  ``transport`` says which one a client uses, ``local_address()`` still names the
  loopback address.
* **Authentication and TLS** (handshake.py): with ``DISTLIB_AUTH_TOKEN`` the client and the
  server prove the token to each other before any request; with ``DISTLIB_TLS_CA`` the TCP
  connection is TLS and the server's certificate is checked. Without either, the bytes are
  torch's.
* Replies are polled for (a short busy-poll, then poll(2)), each with a deadline, over a
  non-blocking socket (client_channel.py).
* Connecting retries with backoff until the timeout and then fails naming host:port and
  what went wrong (connect.py); a port where something accepts and stays silent is named as
  another service.
* The master waits for its workers on a condition the in-process server signals, not by
  polling every 10 ms; its timeout error lists where the workers that did join came from.
* **In-process clients keep the server's order**: a client whose server runs on a thread of
  this process confirms each request without reply with a PING before its next request
  (client_channel.py says why).
* A zero timeout means "do not wait", as torch's TCPStore reads it.
* Every error names the server (host:port).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from datetime import timedelta
from functools import partial
from typing import List, Optional, Sequence

from ... import settings
from ...deadline import Deadline, TimeoutLike, as_seconds, format_duration
from ...errors import DistStoreError, QueueEmptyError
from ..base import Store, ValueLike, check_key, check_keys, to_bytes
from . import codec
from .client_channel import ConnectionLost, WaitTimedOut, close_socket
from .codec import I64, MAX_KEY_BYTES, MAX_VALUE_BYTES, READY, STOP_WAITING, U32, U64, WORKER_COUNTER_KEY
from .connect import describe_socket, format_endpoint
from .in_process import InProcessServer, serves_here, start_server
from .reconnecting import ReconnectingChannel
from .security import StoreSecurity

log = logging.getLogger("distlib.store.tcp.client")

_u64 = U64.unpack_from
_i64 = I64.unpack_from
# The requests of the hot paths, bound once (every request is built by codec.py's encoders).
_encode_set = codec.set_
_encode_wait_then_get = codec.wait_then_get
_encode_add = codec.add
_encode_check = codec.check
_encode_wait = codec.wait


# -- the client --------------------------------------------------------------------------------


class TCPStore(ReconnectingChannel, Store):
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
        *,
        security: Optional[StoreSecurity] = None,
        reconnect_timeout: Optional[TimeoutLike] = None,
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
        # distlib's own argument: the token and TLS settings (None: the environment's, which
        # is what every rank and the master read; see security.py and docs/security.md).
        self._security = security if security is not None else StoreSecurity.from_env()
        self._use_libuv = bool(use_libuv)
        self._world_size = world_size
        self._lock = threading.Lock()
        # distlib's own: how long a client of a distlib server reconnects after its connection
        # dropped (default: DISTLIB_STORE_RECONNECT_TIMEOUT, else the store timeout; 0: fail at
        # once, as torch's client; reconnecting.py)
        self._init_reconnecting(settings.store_reconnect_timeout() if reconnect_timeout is None
                                else as_seconds(reconnect_timeout, "reconnect_timeout"))
        self._server: Optional[InProcessServer] = None
        self._server_finalizer: Optional[weakref.finalize] = None
        deadline = Deadline(self._timeout_s)

        if is_master:
            self._server = start_server(host_name, port, multi_tenant, master_listen_fd, self._security)
            if self._server is not None:
                port = self._server.server.port
                self._server_finalizer = weakref.finalize(self, self._server.release)
        self._port = port
        self._init_channel(in_process=serves_here(port))  # its server on a thread of this process?
        self._connect(deadline)
        self._finalizer = weakref.finalize(self, close_socket, self._sock)

        if world_size is not None and wait_for_workers:
            with self._lock:
                data = self._numbered(codec.add(WORKER_COUNTER_KEY, 1))
                try:  # (the count it answers is the master's to wait on: below)
                    self._send(data)
                    self._read_i64("ADD init/")
                except ConnectionLost as exc:
                    self._resume(exc, "ADD init/", data, partial(self._read_i64, "ADD init/"))
            if self._server is not None:
                self._server.wait_for_workers(world_size, deadline)

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

    def local_address(self) -> Optional[str]:
        """The local IP of this client's connection: the route to the master that works."""
        if self._local_ip is not None:  # the same-host socket: the loopback route it stands for
            return self._local_ip
        try:
            return self._sock.getsockname()[0]
        except OSError:
            return None

    @property
    def transport(self) -> str:
        """``"unix"`` over the same-host socket of a distlib server, else ``"tcp"``."""
        return "unix" if self._local_ip is not None else "tcp"

    def __repr__(self) -> str:
        server = f"TCPServer(port={self._server.server.port})" if self._server is not None else "<nullptr>"
        return f"TCPStore(client=TCPClient(SocketImpl({describe_socket(self._sock)})), server={server})"

    def close(self) -> None:
        """Close this client's connection (and stop the server if this object owns it last)."""
        with self._lock:
            self._unacked = None  # closed on purpose: nothing to reconnect
            self._broken = self._broken or f"this TCPStore ({self.describe()}) was closed"
            self._finalizer()
            if self._server_finalizer is not None:
                self._server_finalizer()

    # -- keys ------------------------------------------------------------------------------------

    @staticmethod
    def _wire(key: str) -> bytes:
        if type(key) is not str:
            check_key(key)  # raises for anything that is not a str
        data = ("/" + key).encode()
        if len(data) > MAX_KEY_BYTES:
            raise ValueError(f"TCPStore key of {len(data)} bytes exceeds the limit of {MAX_KEY_BYTES} bytes")
        return data

    @classmethod
    def _wires(cls, keys: Sequence[str]) -> List[bytes]:
        if type(keys) is list and len(keys) == 1:  # check([k]), wait([k]): the usual case
            return [cls._wire(keys[0])]  # (_wire rejects a key that is not a str)
        return [cls._wire(k) for k in check_keys(keys)]

    @staticmethod
    def _value(value: ValueLike, what: str = "value") -> bytes:
        data = value if type(value) is bytes else to_bytes(value, what)
        if len(data) > MAX_VALUE_BYTES:
            raise ValueError(f"TCPStore {what} of {len(data)} bytes exceeds the limit of {MAX_VALUE_BYTES} bytes")
        return data

    def _timeout_error(self, wire_keys: Sequence[bytes], seconds: float) -> DistStoreError:
        shown = [k.decode("utf-8", "replace") for k in wire_keys]
        return self.wait_timeout_error(shown, seconds, "the keys were never set")

    # -- the Store API ---------------------------------------------------------------------------

    # Every request is built by codec.py's encoders (tests/store/test_tcp_store.py pins the
    # bytes); the hot paths (set, get, add, check, compare_set, wait) read short replies
    # straight from the buffer.

    def set(self, key: str, value: ValueLike) -> None:
        if type(key) is not str:
            check_key(key)
        wire = ("/" + key).encode()
        if type(value) is not bytes:
            value = to_bytes(value)
        if len(wire) > MAX_KEY_BYTES or len(value) > MAX_VALUE_BYTES:
            self._wire(key), self._value(value)  # raise with the usual text
        data = _encode_set(wire, value)
        with self._lock:
            try:
                self._send_unanswered(data, "SET")
            except ConnectionLost as exc:
                self._resume(exc, "SET")

    def get(self, key: str) -> bytes:
        wire = self._wire(key)
        seconds = self._timeout_s
        with self._lock:
            if not self._ordered:
                return self._get_from_torch_server(wire, seconds)
            data = _encode_wait_then_get(wire)
            try:
                self._send(data)
                return self._read_get(wire, seconds, seconds)
            except ConnectionLost as exc:
                deadline = Deadline(seconds)  # (the wait starts again: the key may be set meanwhile)
                return self._resume(exc, "GET", data, lambda: self._read_get(wire, deadline.remaining(), seconds))

    def _read_get(self, wire: bytes, left: float, seconds: float) -> bytes:
        """The reply to WAIT + GET of ``wire``: STOP_WAITING and the value, within ``left``."""
        buf = self._rbuf
        if not buf:
            try:
                self._recv("GET", left)
            except WaitTimedOut:
                done, value = self._cancel_timed_out_wait("GET", lambda: self._read_blob("GET"))
                if not done:
                    raise self._timeout_error([wire], seconds) from None
                return value
        if buf[0] != STOP_WAITING:
            raise self._fail(f"Stop_waiting response is expected (got {buf[0]})")
        if len(buf) >= 9:
            end = 9 + _u64(buf, 1)[0]
            if len(buf) >= end:  # the usual case: the whole reply came in one read
                value = bytes(buf[9:end])
                del buf[:end]
                return value
        del buf[:1]
        return self._read_blob("GET")

    def _get_from_torch_server(self, wire: bytes, seconds: float) -> bytes:
        """torch's sequence: WAIT, then GET. A libuv server may wake a WAIT although the key
        does not exist (a compare_set that changed nothing); an empty value is re-checked."""
        deadline = Deadline(seconds)
        while True:
            self._send(_encode_wait((wire,)))
            done, _ = self._await_wait(deadline.remaining(), "WAIT")
            if not done:
                raise self._timeout_error([wire], seconds)
            self._send(codec.get(wire))
            value = self._read_blob("GET")
            if value:
                return value
            self._send(_encode_check((wire,)))
            if self._read_u8("CHECK") == READY:
                return value

    def add(self, key: str, amount: int) -> int:
        wire = self._wire(key)
        data = _encode_add(wire, int(amount))
        with self._lock:
            if self._unacked is not None:
                data = self._numbered(data)
            try:
                self._send(data)
                return self._read_i64("ADD")
            except ConnectionLost as exc:
                return self._resume(exc, "ADD", data, partial(self._read_i64, "ADD"))

    def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        wire = self._wire(key)
        expected = self._value(expected_value, "expected_value")
        desired = self._value(desired_value, "desired_value")
        data = codec.compare_set(wire, expected, desired)
        with self._lock:
            data = self._numbered(data)
            try:
                self._send(data)
                return self._read_blob("COMPARE_SET")
            except ConnectionLost as exc:
                return self._resume(exc, "COMPARE_SET", data, partial(self._read_blob, "COMPARE_SET"))

    def check(self, keys: List[str]) -> bool:
        data = _encode_check(self._wires(keys))
        with self._lock:
            try:
                self._send(data)
                return self._read_u8("CHECK") == READY
            except ConnectionLost as exc:
                return self._resume(exc, "CHECK", data, partial(self._read_u8, "CHECK")) == READY

    def wait(self, keys: List[str], timeout: Optional[TimeoutLike] = None) -> None:
        wires = self._wires(keys)
        seconds = self._wait_seconds(timeout) if timeout is not None else self._timeout_s
        data = _encode_wait(wires)
        with self._lock:
            try:
                self._send(data)
                done, _ = self._await_wait(seconds, "WAIT")
            except ConnectionLost as exc:
                deadline = Deadline(seconds)
                done, _ = self._resume(exc, "WAIT", data, lambda: self._await_wait(deadline.remaining(), "WAIT"))
        if not done:
            raise self._timeout_error(wires, seconds)

    def delete_key(self, key: str) -> bool:
        data = codec.delete_key(self._wire(key))
        with self._lock:
            data = self._numbered(data)
            try:
                self._send(data)
                return self._read_i64("DELETE_KEY") == 1
            except ConnectionLost as exc:
                return self._resume(exc, "DELETE_KEY", data, partial(self._read_i64, "DELETE_KEY")) == 1

    def num_keys(self) -> int:
        data = codec.getnumkeys()
        with self._lock:
            try:
                self._send(data)
                return self._read_i64("GETNUMKEYS")
            except ConnectionLost as exc:
                return self._resume(exc, "GETNUMKEYS", data, partial(self._read_i64, "GETNUMKEYS"))

    def has_extended_api(self) -> bool:
        return True

    def append(self, key: str, value: ValueLike) -> None:
        data = codec.append(self._wire(key), self._value(value))
        with self._lock:
            try:
                self._send_unanswered(self._numbered(data), "APPEND")
            except ConnectionLost as exc:
                self._resume(exc, "APPEND")

    def multi_get(self, keys: List[str]) -> List[bytes]:
        wires = self._wires(keys)
        seconds = self._timeout_s

        def read_values() -> List[bytes]:
            return [self._read_blob("MULTI_GET") for _ in wires]

        with self._lock:
            if self._ordered:
                data = codec.wait(wires) + codec.multi_get(wires)
                try:
                    self._send(data)
                    done, values = self._await_wait(seconds, "MULTI_GET", read_values)
                except ConnectionLost as exc:
                    deadline = Deadline(seconds)
                    done, values = self._resume(exc, "MULTI_GET", data, lambda: self._await_wait(
                        deadline.remaining(), "MULTI_GET", read_values))
                if not done:
                    raise self._timeout_error(wires, seconds)
                return values
            self._send(codec.wait(wires))
            done, _ = self._await_wait(seconds, "WAIT")
            if not done:
                raise self._timeout_error(wires, seconds)
            self._send(codec.multi_get(wires))
            return read_values()

    def multi_set(self, keys: List[str], values: List[ValueLike]) -> None:
        wires = self._wires(keys)
        values = list(values)
        if len(wires) != len(values):
            raise DistStoreError(
                f"multiSet keys and values vectors must be of same size ({len(wires)} keys, {len(values)} values)")
        data = codec.multi_set(wires, [self._value(v) for v in values])
        with self._lock:
            try:
                self._send_unanswered(self._numbered(data), "MULTI_SET")
            except ConnectionLost as exc:
                self._resume(exc, "MULTI_SET")

    def _require_queues(self) -> None:
        if not self._use_libuv:
            raise NotImplementedError("queues not implemented on legacy TCPStore backend")

    def queue_push(self, key: str, value: ValueLike) -> None:
        self._require_queues()
        data = codec.queue_push(self._wire(key), self._value(value))
        with self._lock:
            try:
                self._send_unanswered(self._numbered(data), "QUEUE_PUSH")
            except ConnectionLost as exc:
                self._resume(exc, "QUEUE_PUSH")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        self._require_queues()
        wire = self._wire(key)
        with self._lock:
            if block:
                data = codec.wait((wire,))
                try:
                    self._send(data)
                    done, _ = self._await_wait(self._timeout_s, "WAIT")
                except ConnectionLost as exc:
                    deadline = Deadline(self._timeout_s)
                    done, _ = self._resume(exc, "WAIT", data, lambda: self._await_wait(deadline.remaining(), "WAIT"))
                if not done:
                    raise self._timeout_error([wire], self._timeout_s)
            data = self._numbered(codec.queue_pop(wire))
            try:
                self._send(data)
                return self._read_popped()
            except ConnectionLost as exc:
                return self._resume(exc, "QUEUE_POP", data, self._read_popped)

    def _read_popped(self) -> bytes:
        length = self._read_i64("QUEUE_POP")
        if length <= 0:
            raise QueueEmptyError("queue is empty")
        return self._read_blob("QUEUE_POP")

    def queue_len(self, key: str) -> int:
        self._require_queues()
        data = codec.queue_len(self._wire(key))
        with self._lock:
            try:
                self._send(data)
                return self._read_i64("QUEUE_LEN")
            except ConnectionLost as exc:
                return self._resume(exc, "QUEUE_LEN", data, partial(self._read_i64, "QUEUE_LEN"))

    def list_keys(self) -> List[str]:
        """User keys (those a torch client wrote with its leading slash), slash removed."""
        def read_keys() -> List[bytes]:
            count = self._read_i64("LIST_KEYS")
            return [self._read_blob("LIST_KEYS") for _ in range(count)]

        data = codec.list_keys()
        with self._lock:
            try:
                self._send(data)
                raw = read_keys()
            except ConnectionLost as exc:
                raw = self._resume(exc, "LIST_KEYS", data, read_keys)
        return [k[1:].decode("utf-8", "replace") for k in raw if k.startswith(b"/")]

    def barrier(self, key: str, world_size: int, timeout: Optional[TimeoutLike] = None) -> None:
        """The server-side BARRIER: returns when ``world_size`` callers have arrived."""
        seconds = self._wait_seconds(timeout)
        data = codec.barrier(self._wire(key), int(world_size))
        with self._lock:
            data = self._numbered(data)  # (re-sent, it is not counted twice)
            try:
                self._send(data)
                done, _ = self._await_wait(seconds, "BARRIER")
            except ConnectionLost as exc:
                deadline = Deadline(seconds)
                done, _ = self._resume(exc, "BARRIER", data, lambda: self._await_wait(deadline.remaining(), "BARRIER"))
        if not done:
            raise DistStoreError(
                f"barrier timeout after {int(seconds * 1000)}ms, key: {key} "
                f"(waited {format_duration(seconds)} on {self.describe()} for {world_size} participants)")

    def ping(self) -> float:
        """Round trip of a PING, in seconds (a health check)."""
        nonce = os.getpid() & 0xFFFFFFFF
        deadline = Deadline(self._timeout_s)
        data = codec.ping(nonce)
        with self._lock:
            try:
                self._send(data)
                echoed = U32.unpack(self._read(4, "PING"))[0]
            except ConnectionLost as exc:
                echoed = U32.unpack(self._resume(exc, "PING", data, partial(self._read, 4, "PING")))[0]
        if echoed != nonce:
            raise self._fail(f"Ping failed, invalid value returned from server. Expected: {nonce}, Got: {echoed}")
        return deadline.elapsed()

    def clone(self) -> "TCPStore":
        """A new connection to the same server (no worker counting), as torch's clone()."""
        return TCPStore(self._host, self._port, None, False, timedelta(seconds=self._timeout_s),
                        use_libuv=self._use_libuv, security=self._security, reconnect_timeout=self._reconnect_s)
