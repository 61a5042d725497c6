"""Setting up a gloo group, in order:

1. listen on the advertised address (transport/address.py), in DISTLIB_PORT_RANGE if set;
   only on that address (every interface with DISTLIB_MESH_BIND_ALL=1): peers connect to it,
   and nothing else needs to reach the listener;
2. publish the address and host identity, wait for every rank's (backends/join.py: logs
   progress, names the missing ranks on timeout); check that every rank agrees on whether
   the job has a token (DISTLIB_AUTH_TOKEN), so a rank without it is told so at once;
3. connect the mesh (one per GLOO_SOCKET_IFNAME interface; collectives round-robin), every
   connection authenticated with the token when there is one (transport/connection.py);
4. if every rank is on this host (and DISTLIB_SHM is not 0): the small-collective channel
   (transport/shm_channel.py), through which every collective whose per-rank part fits the
   channel's slot goes, without a system call when the ranks are running.
"""

from __future__ import annotations

import logging
import secrets
from typing import List, Optional, Tuple

from ... import auth, settings
from ...cpus import usable_cpus
from ...deadline import Deadline
from ...errors import DistBackendError
from ...identity import Identity
from ...net import format_endpoint as net_endpoint
from ...store.chain import innermost
from ..join import local_facts, publish_and_gather
from .shared_segments import ContextFactory, agree_on_segment
from .transport import address as addr
from .transport import shm_channel, shm_wait
from .transport.connection import crowded_receive_buffer
from .transport.shm_channel import SmallChannel
from .transport.tcp import Mesh

#: The backend's logger (users filter on its name).
log = logging.getLogger("distlib.backends.gloo")

def connect_group(store, rank: int, size: int, timeout_s: float, label: str, deadline: Deadline,
                  meshes: List[Mesh], identity: Identity = Identity()) -> Tuple[list, bool, bool]:
    """Steps 1-3: every mesh connected, appended to ``meshes`` as it is (the caller closes
    them if this raises); ``identity``'s node goes into the join record. Returns (every rank's join record, whether all ranks are on this
    host, whether this machine runs more of the group's ranks than this process has CPUs)."""
    token = auth.configured_token()
    advertised = addr.advertised_addresses(innermost(store))
    listeners: list = []
    try:
        for address, why in advertised:
            bind_to = ("::" if ":" in address else "0.0.0.0") if settings.mesh_bind_all() else address
            listeners.append(addr.listen(bind_to, settings.port_range(), backlog=max(16, size)))
            log.debug("%s: rank %d advertises %s (%s), listens on %s", label, rank, address, why, bind_to)
        record = dict(local_facts(identity))
        if token is not None:
            record["auth"] = True  # that it requires the token, never the token
        record["addresses"] = [[address, sock.getsockname()[1]] for (address, _), sock in zip(advertised, listeners, strict=True)]
        record["host_id"] = addr.host_identity()
        if rank == 0:
            record["mesh_id"] = secrets.randbits(63)
        records = publish_and_gather(store, rank, size, record, deadline, f"{label} rank {rank}")
        check_auth_agreement(label, rank, records, token is not None)
        hosts = {rec["host_id"] for rec in records}
        if len(hosts) > 1:
            warn_loopback(label, records)
        mesh_id = int(records[0]["mesh_id"])
        rcvbuf = receive_buffers(records, record["host_id"])
        crowded = sum(on_this_machine(records, record["host_id"])) > usable_cpus()
        for index, listener in enumerate(listeners):
            mesh = Mesh(rank, size, timeout_s, mesh_id + index,
                        f"{label}" + (f"[if{index}]" if len(listeners) > 1 else ""), token=token)
            mesh.listener = listener
            peers = [tuple(rec["addresses"][min(index, len(rec["addresses"]) - 1)]) for rec in records]
            mesh.connect_all(peers, deadline, rcvbuf)
            meshes.append(mesh)
    except BaseException:
        for listener in listeners:
            if not any(mesh.listener is listener for mesh in meshes):
                listener.close()
        raise
    return records, len(hosts) == 1, crowded


def check_auth_agreement(label: str, rank: int, records, has_token: bool) -> None:
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
            f"{label}: rank {rank} has DISTLIB_AUTH_TOKEN, but {where}{more} {verb} not: their mesh "
            f"listeners do not require authentication, and a rank with the token neither connects to nor "
            f"accepts unauthenticated peers. Give every rank the same DISTLIB_AUTH_TOKEN (or "
            f"DISTLIB_AUTH_TOKEN_FILE)")
    raise auth.AuthError(
        f"{label}: {where}{more} {'requires' if len(others) == 1 else 'require'} authentication "
        f"(DISTLIB_AUTH_TOKEN is set there), but rank "
        f"{rank} has no DISTLIB_AUTH_TOKEN. Give every rank the same DISTLIB_AUTH_TOKEN (or "
        f"DISTLIB_AUTH_TOKEN_FILE)")


def on_this_machine(records, host_id: str) -> List[bool]:
    """Per rank: whether it runs on this machine (same kernel; containers included)."""
    kernel = host_id.split("/")[0]
    return [rec["host_id"].split("/")[0] == kernel for rec in records]


def receive_buffers(records, host_id: str) -> List[int]:
    """Per peer: SO_RCVBUF for a peer on this machine (same kernel) when the machine runs
    more ranks than this process has CPUs; 0 (autotuning) otherwise (see
    transport.connection.crowded_receive_buffer)."""
    here = on_this_machine(records, host_id)
    size = crowded_receive_buffer(sum(here), usable_cpus())
    return [size if same else 0 for same in here]


def warn_loopback(label: str, records) -> None:
    for r, rec in enumerate(records):
        address = rec["addresses"][0][0]
        if addr.is_loopback(address):
            log.warning(
                "%s: rank %d advertises the loopback address %s, but the group spans %d hosts: ranks on "
                "other hosts cannot reach it. Set GLOO_SOCKET_IFNAME on rank %d's host (the 127.0.1.1 trap: "
                "its host name resolves to loopback in /etc/hosts)", label, r, address,
                len({x["host_id"] for x in records}), r)


def small_channel(make_ctx: ContextFactory, rank: int, size: int, slot: int, timeout_s: float, label: str,
                  mesh: Mesh, all_local: bool) -> Optional[SmallChannel]:
    """Step 4, collective (every rank of the group, at init): the small-collective channel
    with slots of ``slot`` bytes (sizes.small_slot_bytes), or None."""
    if size < 2 or not all_local or not settings.shared_memory() or not shm_channel.supported():
        return None
    try:
        segment = agree_on_segment(make_ctx, rank, shm_channel.bytes_needed(size, slot),
                                   "small collectives", label, prefix="distlib-small")
    except DistBackendError:
        if mesh.error is None:
            raise
        # Ranks that finished setting up may already run (and fail) the group's first
        # operation, and its abort can reach this rank before the last vote does. The
        # group is joined: its first operation here raises that abort's reason.
        return None
    if segment is None:
        return None
    policy = shm_wait.decide(size, usable_cpus())
    channel = SmallChannel(segment, rank, size, slot, mesh.health, policy, timeout_s)
    log.debug("%s: rank %d: small collectives through shared memory, %s", label, rank,
              shm_wait.description(policy))
    return channel
