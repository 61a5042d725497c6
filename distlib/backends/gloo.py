"""The ``gloo`` backend: distlib's own CPU collectives, registered under the name users write.

It is not Facebook's gloo (a pure-Python backend cannot join a gloo group; it only shares the
store); it does the same job: a full TCP mesh between the group's ranks (transport/tcp.py),
shared memory between ranks of one host (transport/shm.py), and an algorithm per collective
and size (algorithms/). Setting up, in order:

1. listen on the advertised address (transport/address.py), in DISTLIB_PORT_RANGE if set;
2. publish the address and host identity, wait for every rank's (backends/join.py: logs
   progress, names the missing ranks on timeout);
3. connect the mesh (one per GLOO_SOCKET_IFNAME interface; collectives round-robin);
4. if every rank is on this host, all_reduce of large arrays goes through a shared-memory
   segment, set up on first use (DISTLIB_SHM=0 turns it off).
"""

from __future__ import annotations

import logging
import os
import secrets
from datetime import timedelta
from typing import List, Optional, Sequence

import numpy as np

from ..algorithms import gather as gather_algos
from ..algorithms import reduce as reduce_algos
from ..algorithms.context import OpContext, bview
from ..algorithms.shm_allreduce import ShmAllReduce, mesh_barrier
from ..arrays import dtype_code
from ..cpus import usable_cpus
from ..deadline import Deadline, format_duration
from ..errors import DistBackendError
from ..reduce_op import ReduceOp, finish, prepare_input
from ..transport import address as addr
from ..transport import frames
from ..transport.shm import SharedSegment, free_bytes
from ..transport.tcp import ANY_SOURCE, Mesh, crowded_receive_buffer
from .base import CommBackend, RecvHandle
from .join import local_facts, publish_and_gather

log = logging.getLogger("distlib.backends.gloo")

#: all_reduce of at least this many bytes per rank uses shared memory (all ranks local).
SHM_MIN_BYTES = 256 << 10
#: Bytes per rank per round in the shared segment.
SHM_SLOT_BYTES = int(os.environ.get("DISTLIB_SHM_SLOT_MB", "8")) << 20

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
        self.shm_state = "off" if os.environ.get("DISTLIB_SHM", "1") == "0" else "unset"
        deadline = Deadline(self.timeout_s)
        try:
            self._establish(deadline)
        except BaseException:
            self.shutdown()
            raise

    # -- setting up ------------------------------------------------------------------------------

    def _establish(self, deadline: Deadline) -> None:
        advertised = addr.advertised_addresses(self.store)
        port_range = addr.port_range_from_env()
        listeners = []
        for address, why in advertised:
            bind_to = address if os.environ.get("GLOO_SOCKET_IFNAME") else ("::" if ":" in address else "0.0.0.0")
            listeners.append(addr.listen(bind_to, port_range, backlog=max(16, self.size)))
            log.debug("%s: rank %d advertises %s (%s)", self.label, self.rank, address, why)
        record = dict(local_facts())
        record["addresses"] = [[address, sock.getsockname()[1]] for (address, _), sock in zip(advertised, listeners)]
        record["host_id"] = addr.host_identity()
        if self.rank == 0:
            record["mesh_id"] = secrets.randbits(63)
        records = publish_and_gather(self.store, self.rank, self.size, record, deadline,
                                     f"{self.label} rank {self.rank}")
        self.records = records
        hosts = {rec["host_id"] for rec in records}
        self.all_local = len(hosts) == 1
        if len(hosts) > 1:
            self._warn_loopback(records)
        mesh_id = int(records[0]["mesh_id"])
        rcvbuf = self._receive_buffers(records, record["host_id"])
        for index, listener in enumerate(listeners):
            mesh = Mesh(self.rank, self.size, self.timeout_s, mesh_id + index,
                        f"{self.label}" + (f"[if{index}]" if len(listeners) > 1 else ""))
            mesh.listener = listener
            peers = [tuple(rec["addresses"][min(index, len(rec["addresses"]) - 1)]) for rec in records]
            mesh.connect_all(peers, deadline, rcvbuf)
            self.meshes.append(mesh)

    @staticmethod
    def _receive_buffers(records, host_id: str) -> List[int]:
        """Per peer: SO_RCVBUF for a peer on this machine (same kernel) when the machine runs
        more ranks than this process has CPUs; 0 (autotuning) otherwise (see
        transport.tcp.crowded_receive_buffer)."""
        kernel = host_id.split("/")[0]
        here = [rec["host_id"].split("/")[0] == kernel for rec in records]
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

    # -- helpers ---------------------------------------------------------------------------------

    def _ctx(self, op_name: str, array: Optional[np.ndarray], redop: Optional[ReduceOp], what: str) -> OpContext:
        seq = self.seq
        self.seq += 1
        mesh = self.meshes[seq % len(self.meshes)]
        dtype = dtype_code(array.dtype) if array is not None else 0
        count = array.size if array is not None else 0
        return OpContext(mesh, seq, op_name, dtype, redop.code if redop is not None else 0, count,
                         Deadline(self.timeout_s), f"{what} (op #{seq})")

    @staticmethod
    def _flat(array: np.ndarray) -> np.ndarray:
        return array.reshape(-1)

    # -- collectives -----------------------------------------------------------------------------

    def all_reduce(self, array: np.ndarray, op: ReduceOp) -> None:
        flat = self._flat(array)
        ctx = self._ctx("all_reduce", flat, op, f"all_reduce of {flat.size} x {flat.dtype}")
        if op.factor is not None:
            flat[...] = prepare_input(op, flat)
        if self.size > 1:
            if self._use_shm(flat.nbytes):
                self.shm.run(ctx, flat, op)
            else:
                reduce_algos.ALL_REDUCE[reduce_algos.choose_all_reduce(flat.nbytes, self.size)](ctx, flat, op)
        finish(op, flat, self.size)

    def _use_shm(self, nbytes: int) -> bool:
        if not self.all_local or nbytes < SHM_MIN_BYTES or self.shm_state == "off":
            return False
        if self.shm_state == "unset":
            self._setup_shm()
        return self.shm is not None

    def _setup_shm(self) -> None:
        """Collective: rank 0 creates the segment, everyone maps it, all agree or all fall back."""
        ctx = self._ctx("broadcast", None, None, "shared-memory setup")
        vote = self._ctx("all_reduce", np.zeros(1, np.int8), ReduceOp.MIN, "shared-memory setup vote")
        sync = self._ctx("shm_sync", None, None, "shared-memory setup barrier")
        size = ShmAllReduce.bytes_needed(self.size, SHM_SLOT_BYTES)
        name = bytearray(64)
        segment = None
        problem = ""
        if self.rank == 0:
            if free_bytes() < size:
                problem = f"/dev/shm has {free_bytes() >> 20} MiB free, {size >> 20} MiB needed"
            else:
                try:
                    segment = SharedSegment.create(size)
                    name[: len(segment.name)] = segment.name.encode()
                except (OSError, DistBackendError) as exc:
                    problem = str(exc)
        gather_algos.broadcast(ctx, np.frombuffer(name, dtype=np.uint8), 0)
        if self.rank != 0 and name[0]:
            try:
                segment = SharedSegment.attach(bytes(name).rstrip(b"\0").decode(), size)
            except (OSError, DistBackendError) as exc:
                problem = str(exc)
        ok = np.array([1 if segment is not None else 0], dtype=np.int8)
        reduce_algos.direct_all_reduce(vote, ok, ReduceOp.MIN)
        mesh_barrier(sync, 0)
        if segment is not None and self.rank == 0:
            segment.unlink()  # every rank has it mapped: the name is no longer needed
        if ok[0] == 1:
            self.shm = ShmAllReduce(segment, self.size, SHM_SLOT_BYTES)
            self.shm_state = "on"
            log.debug("%s: rank %d: all_reduce through shared memory (%d MiB)", self.label, self.rank, size >> 20)
        else:
            if segment is not None:
                segment.close()
            self.shm_state = "off"
            log.warning("%s: rank %d: shared memory unavailable (%s); large all_reduce goes over TCP",
                        self.label, self.rank, problem or "another rank could not map the segment")

    def broadcast(self, array: np.ndarray, root: int) -> None:
        flat = self._flat(array)
        ctx = self._ctx("broadcast", flat, None, f"broadcast of {flat.size} x {flat.dtype} from rank {root}")
        if self.size > 1:
            gather_algos.broadcast(ctx, flat, root)

    def reduce(self, array: np.ndarray, root: int, op: ReduceOp) -> None:
        flat = self._flat(array)
        ctx = self._ctx("reduce", flat, op, f"reduce of {flat.size} x {flat.dtype} to rank {root}")
        work = prepare_input(op, flat) if op.factor is not None else flat
        if self.size > 1:
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
        ctx = self._ctx("all_gather", array, None, f"all_gather of {array.size} x {array.dtype}")
        gather_algos.all_gather(ctx, outputs, array)

    def all_gather_into(self, output: np.ndarray, array: np.ndarray) -> None:
        flat = self._flat(output)
        parts = [flat[k * array.size:(k + 1) * array.size] for k in range(self.size)]
        self.all_gather(parts, array)

    def gather(self, outputs, array: np.ndarray, root: int) -> None:
        ctx = self._ctx("gather", array, None, f"gather of {array.size} x {array.dtype} to rank {root}")
        gather_algos.gather(ctx, outputs, array, root)

    def scatter(self, output: np.ndarray, inputs, root: int) -> None:
        ctx = self._ctx("scatter", output, None, f"scatter of {output.size} x {output.dtype} from rank {root}")
        gather_algos.scatter(ctx, output, inputs, root)

    def reduce_scatter(self, output: np.ndarray, inputs: Sequence[np.ndarray], op: ReduceOp) -> None:
        ctx = self._ctx("reduce_scatter", output, op, f"reduce_scatter of {output.size} x {output.dtype}")
        parts = [prepare_input(op, a) for a in inputs]
        reduce_algos.direct_reduce_scatter(ctx, parts, output, op)
        finish(op, output.reshape(-1), self.size)

    def reduce_scatter_into(self, output: np.ndarray, array: np.ndarray, op: ReduceOp) -> None:
        ctx = self._ctx("reduce_scatter", output, op, f"reduce_scatter of {output.size} x {output.dtype}")
        flat = self._flat(array)
        if output.nbytes * (self.size - 1) <= (256 << 10):
            parts = [prepare_input(op, flat[k * output.size:(k + 1) * output.size]) for k in range(self.size)]
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
        ctx = self._ctx("barrier", None, None, "barrier")
        if self.size > 1:
            gather_algos.barrier(ctx)

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
        if self.shm is not None:
            self.shm.segment.close()
            self.shm = None

    def abort(self, reason: str) -> None:
        for mesh in self.meshes:
            mesh.abort(DistBackendError(reason))
