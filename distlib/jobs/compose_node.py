"""The entry point of one worker container of the Compose cluster (compose/): work out this
node's rank for the rendezvous mode, then ``exec distlib-run``.

    python -m distlib.jobs.compose_node [-- JOB ARGS...]

All settings come from the environment the Compose files set:

=========================  ==================================================================
``DISTLIB_CLUSTER_MODE``   ``tcp`` (default) | ``rank0`` | ``file`` | ``nfs``
``NODES``                  number of worker containers (``--nnodes``)
``NPROC_PER_NODE``         processes per container (default 1)
``DISTLIB_RUN_ID``         the run's id (cluster.sh makes a new one for every run)
``CLUSTER_SERVICE``        DNS name shared by all workers (default ``worker``, the service name)
``MASTER_ENDPOINT``        tcp mode: the master service (default ``master:29500``)
``MASTER_PORT``            rank0 mode: the port rank 0's store listens on (default 29500)
``SHARED_DIR``             file/nfs modes: the shared volume (default ``/shared``)
``JOB_MODULE``             the job (default ``distlib.jobs.train_dp``)
``JOB_ARGS``               extra job arguments, one string (shell-style quoting)
=========================  ==================================================================

How a replica learns its node rank — Compose gives replicas of a service no index:

* ``tcp``: it does not: ``distlib-run --node-rank auto --rdzv-backend c10d`` takes the next
  free rank from the master service (``add`` on ``distlib/run/<run id>/node_rank``).
* ``rank0``, ``file``, ``nfs``: there is no master service before rank 0 exists, so the rank is
  the position of this container's address among the addresses Docker's DNS gives for the
  service name, once all ``NODES`` of them resolve (numeric order). Every replica sees the same
  list, so the ranks are distinct and agree; node 0 (lowest address) hosts the store in rank0
  mode and the others use its address as ``--master-addr``.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import socket
import sys
import time
from typing import List, Optional

PREFIX = "compose_node:"


def log(text: str) -> None:
    sys.stderr.write(f"{PREFIX} {text}\n")
    sys.stderr.flush()


def own_address() -> str:
    """This container's IPv4 address on the cluster network."""
    ifname = (os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") or [""])[0].strip()
    if ifname:
        from ..transport.address import interface_address

        return interface_address(ifname)
    return socket.gethostbyname(socket.gethostname())


def resolve_all(name: str) -> List[str]:
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({info[4][0] for info in infos}, key=ipaddress.ip_address)


def rank_by_dns(service: str, nodes: int, timeout: float) -> "tuple[int, List[str]]":
    """(this node's rank, all node addresses in rank order) once ``nodes`` addresses resolve."""
    me = own_address()
    deadline = time.monotonic() + timeout
    next_log = time.monotonic() + 5
    while True:
        addresses = resolve_all(service)
        if len(addresses) == nodes and me in addresses:
            return addresses.index(me), addresses
        if len(addresses) > nodes:
            raise SystemExit(
                f"{PREFIX} {len(addresses)} containers answer to {service!r} ({', '.join(addresses)}) but "
                f"NODES={nodes}: containers of another run share this network, or the service was scaled "
                f"past NODES; remove them (make cluster-down) and start again")
        now = time.monotonic()
        if now >= deadline:
            raise SystemExit(
                f"{PREFIX} after {timeout:.0f} s only {len(addresses)} of {nodes} workers resolve as "
                f"{service!r} ({', '.join(addresses) or 'none'}; this one is {me}): some worker containers "
                f"did not start; see `make cluster-logs`")
        if now >= next_log:
            log(f"{len(addresses)}/{nodes} workers resolve as {service!r}; waiting for the rest")
            next_log = now + 5
        time.sleep(0.2)


def build_command(argv: List[str]) -> List[str]:
    mode = os.environ.get("DISTLIB_CLUSTER_MODE", "tcp").strip() or "tcp"
    nodes = int(os.environ.get("NODES", "1"))
    nproc = os.environ.get("NPROC_PER_NODE", "1")
    run_id = os.environ.get("DISTLIB_RUN_ID", "").strip()
    if not run_id:
        raise SystemExit(f"{PREFIX} DISTLIB_RUN_ID is not set (compose/cluster.sh sets a new one for every run)")
    service = os.environ.get("CLUSTER_SERVICE", "worker")
    module = os.environ.get("JOB_MODULE", "distlib.jobs.train_dp")
    job_args = list(argv) + shlex.split(os.environ.get("JOB_ARGS", ""))
    dns_timeout = float(os.environ.get("CLUSTER_DNS_TIMEOUT", "120"))
    cmd = ["distlib-run", "--nnodes", str(nodes), "--nproc-per-node", nproc, "--run-id", run_id]
    if mode == "tcp":
        endpoint = os.environ.get("MASTER_ENDPOINT", "master:29500")
        cmd += ["--node-rank", "auto", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        log(f"mode tcp: node rank from the master service at {endpoint} (--node-rank auto)")
    elif mode == "rank0":
        rank, addresses = rank_by_dns(service, nodes, dns_timeout)
        port = os.environ.get("MASTER_PORT", "29500")
        cmd += ["--node-rank", str(rank), "--rdzv-backend", "static",
                "--master-addr", addresses[0], "--master-port", port]
        log(f"mode rank0: node rank {rank} of {nodes} (address {addresses[rank]} among {', '.join(addresses)}); "
            f"node 0 ({addresses[0]}:{port}) hosts the store")
    elif mode in ("file", "nfs"):
        rank, addresses = rank_by_dns(service, nodes, dns_timeout)
        shared = os.environ.get("SHARED_DIR", "/shared").rstrip("/") or "/shared"
        url = f"file://{shared}/{run_id}/store"
        os.environ["DISTLIB_INIT_METHOD"] = url
        cmd += ["--node-rank", str(rank)]
        log(f"mode {mode}: node rank {rank} of {nodes} (address {addresses[rank]} among {', '.join(addresses)}); "
            f"FileStore {url[len('file://'):]}")
    else:
        raise SystemExit(f"{PREFIX} unknown DISTLIB_CLUSTER_MODE={mode!r}: tcp, rank0, file or nfs")
    return cmd + ["-m", module] + job_args


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    cmd = build_command(argv)
    log("exec " + " ".join(shlex.quote(c) for c in cmd))
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
