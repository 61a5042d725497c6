"""The ``gloo`` backend: distlib's own CPU collectives, registered under the name users write.

It is not Facebook's gloo (a pure-Python backend cannot join a gloo group; it only shares the
store); it does the same job: a full TCP mesh between the group's ranks (transport/tcp.py),
shared memory between ranks of one host (transport/shm.py), and an algorithm per collective
and size (algorithms/). Setting up, in order:

1. listen on the advertised address (transport/address.py), in DISTLIB_PORT_RANGE if set;
   only on that address (every interface with DISTLIB_MESH_BIND_ALL=1): peers connect to it,
   and nothing else needs to reach the listener;
2. publish the address and host identity, wait for every rank's (backends/join.py: logs
   progress, names the missing ranks on timeout); check that every rank agrees on whether
   the job has a token (DISTLIB_AUTH_TOKEN), so a rank without it is told so at once;
3. connect the mesh (one per GLOO_SOCKET_IFNAME interface; collectives round-robin), every
   connection authenticated with the token when there is one (transport/tcp.py);
4. if every rank is on this host (and DISTLIB_SHM is not 0): the small-collective channel
   (transport/shm_channel.py), through which every collective whose per-rank part fits
   SMALL_SLOT_BYTES goes, without a system call when the ranks are running; all_reduce of
   large arrays goes through a second segment, set up on its first use.
"""

from __future__ import annotations

import logging
import secrets
from datetime import timedelta
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import auth, settings
from ..algorithms import gather as gather_algos
from ..algorithms import reduce as reduce_algos
from ..algorithms import shm_small
from ..algorithms.context import Label, OpContext, bview
from ..algorithms.shm_allreduce import ShmAllReduce
from ..arrays import DTYPE_CODES as _DTYPES
from ..arrays import device_of, dtype_code
from ..cpus import usable_cpus
from ..deadline import Deadline, format_duration
from ..errors import DistBackendError
from ..net import format_endpoint as net_endpoint
from ..reduce_op import ReduceOp, finish, kernel, prepare_input
from ..transport import address as addr
from ..transport import frames
from ..transport import shm_channel, shm_wait
from ..transport.shm_channel import SmallChannel
from ..transport.connection import crowded_receive_buffer
from ..transport.tcp import ANY_SOURCE, Mesh
from . import cuda_staging
from .base import CommBackend, RecvHandle
from .join import local_facts, publish_and_gather
from .shared_segments import agree_on_segment

log = logging.getLogger("distlib.backends.gloo")

#: all_reduce of at least this many bytes per rank uses shared memory (all ranks local) in
#: rounds (algorithms/shm_allreduce.py); with a small channel, everything above its slot does.
SHM_MIN_BYTES = 256 << 10
#: Bytes per rank per round in the shared segment.
SHM_SLOT_BYTES = 8 << 20
#: Collectives whose part per rank fits a slot of the small channel go through it (all ranks
#: local): SMALL_SLOT_BYTES, or less in large groups, so that an all_reduce (where every rank
#: reads every slot) reads at most SMALL_READ_BYTES per rank. Above the slot the two-phase
#: path of SHM_SLOT_BYTES rounds takes over: the one-exchange channel is faster up to about
#: 256 KiB, level there, behind above (docs/performance-log.md, 2026-11-24).
SMALL_SLOT_BYTES = 256 << 10
SMALL_READ_BYTES = 1 << 20


def small_slot_bytes(size: int) -> int:
    """The small channel's slot in a group of ``size`` ranks (a multiple of 64 bytes)."""
    return max(4096, min(SMALL_SLOT_BYTES, SMALL_READ_BYTES // max(1, size)) // 64 * 64)


_ALL_REDUCE, _BROADCAST, _REDUCE = frames.OPS["all_reduce"], frames.OPS["broadcast"], frames.OPS["reduce"]
_ALL_GATHER, _GATHER, _SCATTER = frames.OPS["all_gather"], frames.OPS["gather"], frames.OPS["scatter"]
_REDUCE_SCATTER = frames.OPS["reduce_scatter"]
_BARRIER_WORD = shm_channel.descriptor(frames.OPS["barrier"], 0, 0, -1)

_MONITOR_ARRIVE, _MONITOR_RELEASE = 0, 1


class _P2PRecv(RecvHandle):
    def __init__(self, mesh: Mesh, slot, deadline: Deadline):
        self.mesh, self.slot, self.deadline = mesh, slot, deadline

    def wait(self) -> int:
        return self.mesh.wait(self.slot, self.deadline)

    def is_completed(self) -> bool:
        return self.slot.done


class GlooBackend(CommBackend):
    name = "gloo"

    def __init__(self, store, rank: int, size: int, timeout: timedelta, label: str = "gloo"):
        super().__init__(store, rank, size, timeout)
        self.timeout_s = timeout.total_seconds()
        self.label = label
        self.seq = 0
        self.meshes: List[Mesh] = []
        self.shm: Optional[ShmAllReduce] = None
        self._large_shm = "unset" if settings.shared_memory() else "off"  # the large all_reduce's segment
        self.small: Optional[SmallChannel] = None
        self._reductions: Dict[tuple, Tuple[int, Any]] = {}
        self.crowded = False
        deadline = Deadline(self.timeout_s)
        try:
            self._establish(deadline)
        except BaseException:
            self.shutdown()
            raise

    # -- setting up ------------------------------------------------------------------------------

    def _establish(self, deadline: Deadline) -> None:
        token = auth.configured_token()
        advertised = addr.advertised_addresses(self.store)
        port_range = settings.port_range()
        bind_all = settings.mesh_bind_all()
        listeners = []
        try:
            self._listen(advertised, port_range, bind_all, listeners)
            self._join_and_connect(deadline, token, advertised, listeners)
        except BaseException:
            for listener in listeners:
                if not any(mesh.listener is listener for mesh in self.meshes):
                    listener.close()
            raise

    def _listen(self, advertised, port_range, bind_all: bool, listeners: List) -> None:
        for address, why in advertised:
            bind_to = ("::" if ":" in address else "0.0.0.0") if bind_all else address
            listeners.append(addr.listen(bind_to, port_range, backlog=max(16, self.size)))
            log.debug("%s: rank %d advertises %s (%s), listens on %s", self.label, self.rank, address, why,
                      bind_to)

    def _join_and_connect(self, deadline: Deadline, token: Optional[bytes], advertised, listeners) -> None:
        record = dict(local_facts())
        if token is not None:
            record["auth"] = True  # that it requires the token, never the token
        record["addresses"] = [[address, sock.getsockname()[1]] for (address, _), sock in zip(advertised, listeners)]
        record["host_id"] = addr.host_identity()
        if self.rank == 0:
            record["mesh_id"] = secrets.randbits(63)
        records = publish_and_gather(self.store, self.rank, self.size, record, deadline,
                                     f"{self.label} rank {self.rank}")
        self.records = records
        self._check_auth_agreement(records, token is not None)
        hosts = {rec["host_id"] for rec in records}
        self.all_local = len(hosts) == 1
        if len(hosts) > 1:
            self._warn_loopback(records)
        mesh_id = int(records[0]["mesh_id"])
        rcvbuf = self._receive_buffers(records, record["host_id"])
        self.crowded = sum(self._on_this_machine(records, record["host_id"])) > usable_cpus()
        for index, listener in enumerate(listeners):
            mesh = Mesh(self.rank, self.size, self.timeout_s, mesh_id + index,
                        f"{self.label}" + (f"[if{index}]" if len(listeners) > 1 else ""), token=token)
            mesh.listener = listener
            peers = [tuple(rec["addresses"][min(index, len(rec["addresses"]) - 1)]) for rec in records]
            mesh.connect_all(peers, deadline, rcvbuf)
            self.meshes.append(mesh)
        self._setup_small()

    def _check_auth_agreement(self, records, has_token: bool) -> None:
        """AuthError at once, on every rank concerned, when some ranks have the job's token and
        others do not (the handshake would fail on the first connection between them, with a
        less direct message, or only at the deadline)."""
        others = [r for r, rec in enumerate(records) if bool(rec.get("auth")) != has_token]
        if not others:
            return
        where = ", ".join(f"rank {r} at {net_endpoint(*records[r]['addresses'][0])}" for r in others[:8])
        more = f" and {len(others) - 8} more" if len(others) > 8 else ""
        verb = "does" if len(others) == 1 else "do"
        if has_token:
            raise auth.AuthError(
                f"{self.label}: rank {self.rank} has DISTLIB_AUTH_TOKEN, but {where}{more} {verb} not: their mesh "
                f"listeners do not require authentication, and a rank with the token neither connects to nor "
                f"accepts unauthenticated peers. Give every rank the same DISTLIB_AUTH_TOKEN (or "
                f"DISTLIB_AUTH_TOKEN_FILE)")
        raise auth.AuthError(
            f"{self.label}: {where}{more} {'requires' if len(others) == 1 else 'require'} authentication "
            f"(DISTLIB_AUTH_TOKEN is set there), but rank "
            f"{self.rank} has no DISTLIB_AUTH_TOKEN. Give every rank the same DISTLIB_AUTH_TOKEN (or "
            f"DISTLIB_AUTH_TOKEN_FILE)")

    @staticmethod
    def _on_this_machine(records, host_id: str) -> List[bool]:
        """Per rank: whether it runs on this machine (same kernel; containers included)."""
        kernel = host_id.split("/")[0]
        return [rec["host_id"].split("/")[0] == kernel for rec in records]

    @staticmethod
    def _receive_buffers(records, host_id: str) -> List[int]:
        """Per peer: SO_RCVBUF for a peer on this machine (same kernel) when the machine runs
        more ranks than this process has CPUs; 0 (autotuning) otherwise (see
        transport.connection.crowded_receive_buffer)."""
        here = GlooBackend._on_this_machine(records, host_id)
        size = crowded_receive_buffer(sum(here), usable_cpus())
        return [size if same else 0 for same in here]

    def _warn_loopback(self, records) -> None:
        for r, rec in enumerate(records):
            address = rec["addresses"][0][0]
            if addr.is_loopback(address):
                log.warning(
                    "%s: rank %d advertises the loopback address %s, but the group spans %d hosts: ranks on "
                    "other hosts cannot reach it. Set GLOO_SOCKET_IFNAME on rank %d's host (the 127.0.1.1 trap: "
                    "its host name resolves to loopback in /etc/hosts)", self.label, r, address,
                    len({x["host_id"] for x in records}), r)

    def for_array(self, array) -> CommBackend:
        """cupy arrays go through host memory (backends/cuda_staging.py), as torch's gloo does."""
        return cuda_staging.staged(self, array) if device_of(array) == "cuda" else self

    def _setup_small(self) -> None:
        """Collective (every rank of an all-local group, at init): the small-collective channel."""
        if self.size < 2 or not self.all_local or not settings.shared_memory() or not shm_channel.supported():
            return
        slot = small_slot_bytes(self.size)
        try:
            segment = agree_on_segment(self._ctx, self.rank, shm_channel.bytes_needed(self.size, slot),
                                       "small collectives", self.label, prefix="distlib-small")
        except DistBackendError:
            if self.meshes[0].error is None:
                raise
            # Ranks that finished setting up may already run (and fail) the group's first
            # operation, and its abort can reach this rank before the last vote does. The
            # group is joined: its first operation here raises that abort's reason.
            return
        if segment is None:
            return
        policy = shm_wait.decide(self.size, usable_cpus())
        self.small = SmallChannel(segment, self.rank, self.size, slot, self.meshes[0].health, policy,
                                  self.timeout_s)
        log.debug("%s: rank %d: small collectives through shared memory, %s", self.label, self.rank,
                  shm_wait.description(policy))

    @property
    def shm_state(self) -> str:
        """Whether all_reduce goes through shared memory: "on" (the small channel, or the large
        segment once set up), "off" (it cannot), "unset" (no channel, and no large all_reduce yet)."""
        return "on" if self.small is not None else self._large_shm

    # -- helpers ---------------------------------------------------------------------------------

    def _ctx(self, op_name: str, array: Optional[np.ndarray], redop: Optional[ReduceOp], what: str,
             *args, root: int = -1, announce: bool = True) -> OpContext:
        """The next operation's context, for an operation that goes over the mesh (and, in a
        group with a small-collective channel, announced there: see shm_channel).
        ``what.format(*args)`` names it in errors (formatted only then)."""
        seq = self.seq
        self.seq += 1
        mesh = self.meshes[seq % len(self.meshes)]
        dtype = _DTYPES.get(array.dtype, 0) if array is not None else 0
        count = array.size if array is not None else 0
        op = frames.OPS[op_name]
        redop_code = redop.code if redop is not None else 0
        if self.small is not None and announce:
            self.small.announce(shm_channel.stamp(seq), shm_channel.descriptor(op, dtype, redop_code, root), count)
        mesh.begin(seq, op, dtype, redop_code, count)
        return OpContext(mesh, seq, op_name, dtype, redop_code, count, Deadline(self.timeout_s),
                         Label(what + " (op #{})", *args, seq))

    def _next_small(self, nbytes: int) -> int:
        """The operation number of the next operation if it goes through the small channel
        (``nbytes``: what each rank's slot must hold), else -1."""
        small = self.small
        if small is None or nbytes > small.slot_bytes:
            return -1
        seq = self.seq
        self.seq = seq + 1
        return seq

    def _reduction(self, code: int, op: ReduceOp, dtype: np.dtype, root: int = -1) -> Tuple[int, Any]:
        """(descriptor word, ufunc) of a reduction through the channel, kept: working them out
        costs about a tenth of a small all_reduce."""
        key = (code, op.op, dtype, root)
        found = self._reductions.get(key)
        if found is None:
            word = shm_channel.descriptor(code, _DTYPES.get(dtype, 0), op.code, root)
            found = self._reductions[key] = (word, kernel(op, dtype))
        return found

    @staticmethod
    def _flat(array: np.ndarray) -> np.ndarray:
        return array.reshape(-1)

    # -- collectives -----------------------------------------------------------------------------

    def all_reduce(self, array: np.ndarray, op: ReduceOp) -> None:
        flat = array.reshape(-1)
        if op.factor is not None:
            flat[...] = prepare_input(op, flat)
        if self.size == 1:
            return finish(op, flat, 1)
        seq = self._next_small(flat.nbytes)
        if seq >= 0:
            word, combine = self._reduction(_ALL_REDUCE, op, flat.dtype)
            shm_small.all_reduce(self.small, seq, flat, combine, word)
        elif self._use_shm(flat, op):
            # its barriers go through the channel (if any): an operation of the channel, not announced
            ctx = self._ctx("all_reduce", flat, op, "all_reduce of {} x {}", flat.size, flat.dtype, announce=False)
            self.shm.run(ctx, flat, op, self.small)
        else:
            ctx = self._ctx("all_reduce", flat, op, "all_reduce of {} x {}", flat.size, flat.dtype)
            algorithm = reduce_algos.choose_all_reduce(flat.nbytes, self.size, self.crowded)
            reduce_algos.ALL_REDUCE[algorithm](ctx, flat, op)
        finish(op, flat, self.size)

    def _use_shm(self, flat: np.ndarray, op: ReduceOp) -> bool:
        """Whether a large all_reduce goes through the shared segment (set up on first use,
        before the operation's own context is made: the setup is operations of its own)."""
        least = self.small.slot_bytes + 1 if self.small is not None else SHM_MIN_BYTES
        if not self.all_local or flat.nbytes < least or self._large_shm == "off":
            return False
        if self._large_shm == "unset":
            if self.small is not None:  # a rank waiting in the channel sees the all_reduce, not the setup
                word = shm_channel.descriptor(_ALL_REDUCE, _DTYPES.get(flat.dtype, 0), op.code, -1)
                self.small.announce(shm_channel.stamp(self.seq), word, flat.size)
            segment = agree_on_segment(partial(self._ctx, announce=False), self.rank,
                                       ShmAllReduce.bytes_needed(self.size, SHM_SLOT_BYTES), "large all_reduce",
                                       self.label)
            self.shm = ShmAllReduce(segment, self.size, SHM_SLOT_BYTES) if segment is not None else None
            self._large_shm = "on" if segment is not None else "off"
        return self.shm is not None

    def broadcast(self, array: np.ndarray, root: int) -> None:
        flat = array.reshape(-1)
        if self.size == 1:
            return
        seq = self._next_small(flat.nbytes)
        if seq >= 0:
            word = shm_channel.descriptor(_BROADCAST, _DTYPES.get(flat.dtype, 0), 0, root)
            shm_small.broadcast(self.small, seq, flat, root, word)
            return
        ctx = self._ctx("broadcast", flat, None, "broadcast of {} x {} from rank {}", flat.size, flat.dtype, root,
                        root=root)
        gather_algos.broadcast(ctx, flat, root)

    def reduce(self, array: np.ndarray, root: int, op: ReduceOp) -> None:
        flat = self._flat(array)
        work = prepare_input(op, flat) if op.factor is not None else flat
        if self.size > 1:
            seq = self._next_small(flat.nbytes)
            if seq >= 0:
                word, combine = self._reduction(_REDUCE, op, flat.dtype, root)
                if self.rank == root and work is not flat:
                    flat[...] = work
                    work = flat
                shm_small.reduce(self.small, seq, work, root, combine, word)
            else:
                ctx = self._ctx("reduce", flat, op, "reduce of {} x {} to rank {}", flat.size, flat.dtype, root,
                                root=root)
                if work is flat and self.rank != root:
                    work = flat.copy()
                if flat.nbytes * (self.size - 1) <= (256 << 10):
                    reduce_algos.direct_reduce(ctx, work, root, op)
                else:
                    reduce_algos.ring_reduce(ctx, work, root, op)
        if self.rank == root:
            if work is not flat:
                flat[...] = work
            finish(op, flat, self.size)

    def all_gather(self, outputs: Sequence[np.ndarray], array: np.ndarray) -> None:
        if self.size > 1:
            seq = self._next_small(array.nbytes)
            if seq >= 0:
                word = shm_channel.descriptor(_ALL_GATHER, _DTYPES.get(array.dtype, 0), 0, -1)
                shm_small.all_gather(self.small, seq, [o.reshape(-1) for o in outputs], array.reshape(-1), word)
                return
        ctx = self._ctx("all_gather", array, None, "all_gather of {} x {}", array.size, array.dtype)
        gather_algos.all_gather(ctx, outputs, array)

    def all_gather_into(self, output: np.ndarray, array: np.ndarray) -> None:
        flat = self._flat(output)
        parts = [flat[k * array.size:(k + 1) * array.size] for k in range(self.size)]
        self.all_gather(parts, array)

    def gather(self, outputs, array: np.ndarray, root: int) -> None:
        if self.size > 1:
            seq = self._next_small(array.nbytes)
            if seq >= 0:
                word = shm_channel.descriptor(_GATHER, _DTYPES.get(array.dtype, 0), 0, root)
                flat_outputs = [o.reshape(-1) for o in outputs] if outputs is not None else None
                shm_small.gather(self.small, seq, flat_outputs, array.reshape(-1), root, word)
                return
        ctx = self._ctx("gather", array, None, "gather of {} x {} to rank {}", array.size, array.dtype, root,
                        root=root)
        gather_algos.gather(ctx, outputs, array, root)

    def scatter(self, output: np.ndarray, inputs, root: int) -> None:
        if self.size > 1:
            seq = self._next_small(output.nbytes * self.size)
            if seq >= 0:
                word = shm_channel.descriptor(_SCATTER, _DTYPES.get(output.dtype, 0), 0, root)
                pieces = [i.reshape(-1) for i in inputs] if inputs is not None else None
                shm_small.scatter(self.small, seq, output.reshape(-1), pieces, root, word)
                return
        ctx = self._ctx("scatter", output, None, "scatter of {} x {} from rank {}", output.size, output.dtype, root,
                        root=root)
        gather_algos.scatter(ctx, output, inputs, root)

    def _small_reduce_scatter(self, parts: List[np.ndarray], output: np.ndarray, op: ReduceOp) -> bool:
        seq = self._next_small(output.nbytes * self.size) if self.size > 1 else -1
        if seq < 0:
            return False
        word, combine = self._reduction(_REDUCE_SCATTER, op, output.dtype)
        shm_small.reduce_scatter(self.small, seq, parts, output.reshape(-1), combine, word)
        finish(op, output.reshape(-1), self.size)
        return True

    def reduce_scatter(self, output: np.ndarray, inputs: Sequence[np.ndarray], op: ReduceOp) -> None:
        parts = [prepare_input(op, a.reshape(-1)) for a in inputs]
        if self._small_reduce_scatter(parts, output, op):
            return
        ctx = self._ctx("reduce_scatter", output, op, "reduce_scatter of {} x {}", output.size, output.dtype)
        reduce_algos.direct_reduce_scatter(ctx, parts, output, op)
        finish(op, output.reshape(-1), self.size)

    def reduce_scatter_into(self, output: np.ndarray, array: np.ndarray, op: ReduceOp) -> None:
        flat = self._flat(array)
        m = output.size
        if self.small is not None and output.nbytes * self.size <= self.small.slot_bytes:
            parts = [prepare_input(op, flat[k * m:(k + 1) * m]) for k in range(self.size)]
            if self._small_reduce_scatter(parts, output, op):
                return
        ctx = self._ctx("reduce_scatter", output, op, "reduce_scatter of {} x {}", output.size, output.dtype)
        if output.nbytes * (self.size - 1) <= (256 << 10):
            parts = [prepare_input(op, flat[k * m:(k + 1) * m]) for k in range(self.size)]
            reduce_algos.direct_reduce_scatter(ctx, parts, output, op)
        else:
            work = prepare_input(op, flat)
            work = work.copy() if work is flat else work
            reduce_algos.ring_reduce_scatter_into(ctx, work, output, op)
        finish(op, output.reshape(-1), self.size)

    def all_to_all(self, outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> None:
        ref = inputs[0] if inputs else None
        ctx = self._ctx("all_to_all", ref, None, "all_to_all")
        gather_algos.all_to_all(ctx, [bview(o) for o in outputs], [bview(i) for i in inputs])

    def all_to_all_single(self, output: np.ndarray, array: np.ndarray,
                          output_splits: List[int], input_splits: List[int]) -> None:
        ctx = self._ctx("all_to_all", array, None, "all_to_all_single")
        row_out = int(np.prod(output.shape[1:])) if output.ndim > 1 else 1
        row_in = int(np.prod(array.shape[1:])) if array.ndim > 1 else 1
        outs = gather_algos.split_views(self._flat(output), output_splits, row_out)
        ins = gather_algos.split_views(self._flat(array), input_splits, row_in)
        gather_algos.all_to_all(ctx, outs, ins)

    def barrier(self) -> None:
        if self.size == 1:
            return
        seq = self._next_small(0)
        if seq >= 0:
            shm_small.barrier(self.small, seq, _BARRIER_WORD)
            return
        gather_algos.barrier(self._ctx("barrier", None, None, "barrier"))

    def monitored_barrier(self, timeout: timedelta, wait_all_ranks: bool) -> None:
        """Rank 0 waits up to ``timeout`` for each rank, then names those that did not come."""
        ctx = self._ctx("monitored_barrier", None, None, "monitored_barrier")
        if self.size == 1:
            return
        mesh = ctx.mesh
        limit = Deadline(timeout.total_seconds())
        status = bytearray(1)
        if self.rank != 0:
            ctx.send(0, memoryview(bytearray(0)), _MONITOR_ARRIVE)
            slot = ctx.post(0, memoryview(status), _MONITOR_RELEASE)
            mesh.wait(slot, Deadline(timeout.total_seconds() + 5.0))
            if status[0]:
                raise DistBackendError(f"monitored_barrier failed: rank 0 reported that other ranks did not "
                                       f"reach the barrier within {format_duration(timeout.total_seconds())}")
            return
        slots = {r: ctx.post(r, memoryview(bytearray(0)), _MONITOR_ARRIVE) for r in range(1, self.size)}
        failed = []
        for r, slot in slots.items():
            if not mesh.try_wait(slot, limit):
                failed.append(r)
                if not wait_all_ranks:
                    break
        status[0] = 1 if failed else 0
        for r in range(1, self.size):
            if r not in failed:
                try:
                    ctx.send(r, memoryview(status), _MONITOR_RELEASE)
                except DistBackendError:
                    pass
        if failed:
            ms = int(timeout.total_seconds() * 1000)
            if wait_all_ranks:
                raise DistBackendError(
                    f"Ranks {', '.join(map(str, failed))} failed to pass monitoredBarrier in {ms} ms")
            raise DistBackendError(f"Rank {failed[0]} failed to pass monitoredBarrier in {ms} ms")

    # -- point to point --------------------------------------------------------------------------

    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        view = bview(array)
        header = frames.pack(frames.P2P, frames.OPS["send"], dtype_code(array.dtype), 0, tag, 0, array.size,
                             view.nbytes)
        self.meshes[0].send(dst, header, view, Deadline(self.timeout_s),
                            f"send of {array.size} x {array.dtype} to rank {dst} (tag {tag})")

    def post_recv(self, array: np.ndarray, src: Optional[int], tag: int) -> RecvHandle:
        peer = ANY_SOURCE if src is None else src
        what = f"recv of {array.size} x {array.dtype} (tag {tag})"
        slot = self.meshes[0].post_p2p(peer, tag, bview(array), dtype_code(array.dtype), array.size, what)
        return _P2PRecv(self.meshes[0], slot, Deadline(self.timeout_s))

    # -- teardown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        for mesh in self.meshes:
            mesh.close()
        self.meshes = []
        if self.small is not None:
            self.small.close()
            self.small = None
        if self.shm is not None:
            self.shm.segment.close()
            self.shm = None

    def abort(self, reason: str) -> None:
        for mesh in self.meshes:
            mesh.abort(DistBackendError(reason))
