"""The entry point of one worker container of the Compose cluster (compose/): work out this
node's rank for the rendezvous mode, then ``exec distlib-run``.

    python -m distlib_deploy.jobs.compose_node [-- ARGS OF THE DEFAULT JOB...]

All settings come from the environment the Compose files set:

=========================  ==================================================================
``DISTLIB_CLUSTER_MODE``   ``tcp`` (default) | ``rank0`` | ``file`` | ``nfs``
``NODES``                  number of worker containers (``--nnodes``)
``NPROC_PER_NODE``         processes per container (default 1)
``DISTLIB_RUN_ID``         the run's id (``distlib cluster up`` makes a new one for every run)
``CLUSTER_SERVICE``        DNS name shared by all workers (default ``worker``, the service name)
``MASTER_ENDPOINT``        tcp mode: the master service (default ``master:29500``)
``MASTER_PORT``            rank0 mode: the port rank 0's store listens on (default 29500)
``SHARED_DIR``             file/nfs modes: the shared volume (default ``/shared``)
``JOB``                    a user's own job, run in the working directory: ``python script.py
                           args``, ``python -m module args`` (``python``/``python3`` optional)
``JOB_MODULE``             the job when JOB is empty (default ``distlib_deploy.jobs.train_dp``);
                           the arguments after ``--`` go to it (the report paths)
``JOB_ARGS``               extra job arguments, one string (shell-style quoting), for either
``CLUSTER_GPUS_PER_NODE``  GPU=1 (compose/gpu.yml): GPUs this worker takes, one per process
``MIN_NODES``              elastic (compose/elastic.yml): the fewest nodes the job runs with
                           (``--nnodes MIN_NODES:MAX_NODES``)
``MAX_NODES``              elastic: the most nodes a round may have (default ``NODES``)
``MAX_RESTARTS``           elastic: ``--max-restarts`` for the whole job
``RDZV_CONF``              elastic: ``--rdzv-conf`` (heartbeat, timeouts)
``CHECKPOINT_EVERY``       elastic, default job: steps between checkpoints (default 10), kept in
                           ``/workspace/checkpoints/<run id>/`` (the volume every worker mounts)
``STEP_SECONDS``           elastic, default job: ``--step-seconds`` (a pause per step)
=========================  ==================================================================

**Elastic** (``MIN_NODES`` below ``NODES``, or ``MAX_RESTARTS`` above 0; modes tcp, file, nfs):
the node ranks come from the rendezvous rounds (no DNS wait, no ``--node-rank``): a lost node
is not waited for, and a container started later joins at the next round. tcp: the master
service is the rendezvous store; file/nfs: ``file:///shared/<run id>/rdzv`` is.

How a replica learns its node rank — Compose gives replicas of a service no index:

* ``tcp``: it does not: ``distlib-run --node-rank auto --rdzv-backend c10d`` takes the next
  free rank from the master service (``add`` on ``distlib/run/<run id>/node_rank``).
* ``rank0``, ``file``, ``nfs``: there is no master service before rank 0 exists, so the rank is
  the position of this container's address among the addresses Docker's DNS gives for the
  service name, once all ``NODES`` of them resolve (numeric order). Every replica sees the same
  list, so the ranks are distinct and agree; node 0 (lowest address) hosts the store in rank0
  mode and the others use its address as ``--master-addr`` (in the file modes too: the job
  meets through the FileStore, but a script that asks for env:// must not dial its own
  loopback).

With ``CLUSTER_GPUS_PER_NODE`` (GPU=1) every worker sees all of the host's GPUs (Docker gives
the replicas of one service the same devices), and takes its own slice through
``CUDA_VISIBLE_DEVICES``: worker k of the address order (in every mode) gets GPUs
k*n .. k*n+n-1, so no two workers share one; its processes then use ``cuda:LOCAL_RANK``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import socket
import sys
import time
from typing import List, Optional

from distlib import settings

from .. import settings as deploy_settings

from distlib.command import ToolError, run

PREFIX = "compose_node:"
DEFAULT_JOB_MODULE = "distlib_deploy.jobs.train_dp"
#: What a JOB may start with: the interpreter, by any of its usual names.
PYTHON = re.compile(r"(?:.*/)?python(?:3(?:\.\d+)?)?")


def job_program(text: str) -> List[str]:
    """A JOB command line as distlib-run's program: ``[script, args...]`` or ``["-m", module,
    args...]``. ``python``/``python3`` in front is accepted (distlib-run starts the image's
    Python); ValueError, saying what is accepted, for anything else."""
    usage = ("JOB runs Python on every worker: \"python script.py args\", \"python -m module args\" or "
             "\"script.py args\"")
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"JOB={text!r}: {exc}") from None
    python = bool(words) and PYTHON.fullmatch(words[0]) is not None
    if python:
        words = words[1:]
    if not words:
        raise ValueError(f"JOB={text!r}: no script or module. {usage}")
    if words[0] == "-m":
        if len(words) < 2 or words[1].startswith("-"):
            raise ValueError(f"JOB={text!r}: -m needs a module name. {usage}")
        return words
    if words[0].startswith("-"):
        raise ValueError(f"JOB={text!r}: {words[0]} is not supported (only -m). {usage}")
    if not python and not words[0].endswith(".py"):
        raise ValueError(f"JOB={text!r}: {words[0]} is not a Python script. {usage}")
    return words


def log(text: str) -> None:
    sys.stderr.write(f"{PREFIX} {text}\n")
    sys.stderr.flush()


def own_address() -> str:
    """This container's IPv4 address on the cluster network."""
    ifname = (os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") or [""])[0].strip()
    if ifname:
        from distlib.backends.gloo.transport.address import interface_address

        return interface_address(ifname)
    return socket.gethostbyname(socket.gethostname())


def resolve_all(name: str) -> List[str]:
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({str(info[4][0]) for info in infos}, key=ipaddress.ip_address)  # (AF_INET: always a str)


def wait_for_workers(service: str, nodes: int, timeout: float, me: Optional[str] = None) -> List[str]:
    """All ``nodes`` addresses of ``service`` (numeric order), once Docker's DNS gives that many
    (and ``me`` among them, when given). ToolError when more answer, or fewer after ``timeout``."""
    deadline = time.monotonic() + timeout
    next_log = time.monotonic() + 5
    mine = f"; this one is {me}" if me else ""
    while True:
        addresses = resolve_all(service)
        if len(addresses) == nodes and (me is None or me in addresses):
            return addresses
        if len(addresses) > nodes:
            raise ToolError(
                f"{len(addresses)} containers answer to {service!r} ({', '.join(addresses)}) but "
                f"NODES={nodes}: containers of another run share this network, or the service was scaled "
                f"past NODES; remove them (make cluster-down) and start again")
        now = time.monotonic()
        if now >= deadline:
            raise ToolError(
                f"after {timeout:.0f} s only {len(addresses)} of {nodes} workers resolve as "
                f"{service!r} ({', '.join(addresses) or 'none'}{mine}): some worker containers "
                f"did not start; see `make cluster-logs`")
        if now >= next_log:
            log(f"{len(addresses)}/{nodes} workers resolve as {service!r}; waiting for the rest")
            next_log = now + 5
        time.sleep(0.2)


def gpu_slice(slot: int, per_node: int, visible: int, nodes: int) -> List[int]:
    """The GPUs (indices among the ``visible`` ones) of the worker at position ``slot``;
    ToolError when the host has too few for NODES x CLUSTER_GPUS_PER_NODE."""
    first = slot * per_node
    if first + per_node > visible:
        raise ToolError(f"GPU=1: worker {slot} of {nodes} needs GPUs {first}..{first + per_node - 1}, but this "
                        f"container sees {visible} GPU(s): NODES={nodes} x NPROC_PER_NODE={per_node} needs "
                        f"{nodes * per_node}, one per process; lower NODES or NPROC_PER_NODE")
    return list(range(first, first + per_node))


def visible_gpus() -> int:
    """How many CUDA devices this container sees (ToolError, with cupy's reason, when none)."""
    from distlib.backends import cupy_env

    status = cupy_env.status()
    if status.devices == 0:
        raise ToolError(f"GPU=1 but this worker cannot use a GPU: {status.problem}")
    return status.devices


def assign_gpus(service: str, nodes: int, dns_timeout: float, slot: Optional[int]) -> None:
    """GPU=1: this worker's slice of the GPUs into CUDA_VISIBLE_DEVICES (see the module doc)."""
    text = os.environ.get("CLUSTER_GPUS_PER_NODE", "").strip()
    if not text:
        return
    if not text.isdigit() or int(text) < 1:
        raise ToolError(f"CLUSTER_GPUS_PER_NODE={text!r}: a positive number of GPUs per worker")
    if slot is None:
        slot, _ = rank_by_dns(service, nodes, dns_timeout)
    mine = gpu_slice(slot, int(text), visible_gpus(), nodes)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, mine))
    log(f"GPU=1: worker {slot} of {nodes} uses GPUs {os.environ['CUDA_VISIBLE_DEVICES']} "
        f"(CUDA_VISIBLE_DEVICES, {os.environ.get('CUDA_DEVICE_ORDER', 'CUDA')} order)")


def rank_by_dns(service: str, nodes: int, timeout: float) -> "tuple[int, List[str]]":
    """(this node's rank, all node addresses in rank order) once ``nodes`` addresses resolve."""
    me = own_address()
    addresses = wait_for_workers(service, nodes, timeout, me)
    return addresses.index(me), addresses


def program_from_env(argv: List[str]) -> List[str]:
    """The job as Python's arguments (``[script, args...]`` or ``["-m", module, args...]``): JOB
    when set, else JOB_MODULE with ``argv`` (the default job's report paths); JOB_ARGS after."""
    job = os.environ.get("JOB", "").strip()
    extra = shlex.split(os.environ.get("JOB_ARGS", ""))
    if not job:
        return ["-m", os.environ.get("JOB_MODULE", DEFAULT_JOB_MODULE)] + list(argv) + extra
    try:
        return job_program(job) + extra
    except ValueError as exc:
        raise ToolError(str(exc)) from None


def elastic_settings() -> Optional["tuple[int, int, int]"]:
    """(MIN_NODES, MAX_NODES, MAX_RESTARTS) when the job is elastic, else None; ToolError for bad values."""
    nodes = int(os.environ.get("NODES", "1"))
    max_text = os.environ.get("MAX_NODES", "").strip() or str(nodes)
    min_text = os.environ.get("MIN_NODES", "").strip()
    restarts_text = os.environ.get("MAX_RESTARTS", "").strip() or "0"
    if not max_text.isdigit() or int(max_text) < 1:
        raise ToolError(f"MAX_NODES={max_text}: a number of nodes")
    high = int(max_text)
    if min_text and (not min_text.isdigit() or not 1 <= int(min_text) <= high):
        raise ToolError(f"MIN_NODES={min_text}: a number of nodes from 1 to {high}")
    if not restarts_text.isdigit():
        raise ToolError(f"MAX_RESTARTS={restarts_text}: a number of restarts, 0 or more")
    low = int(min_text) if min_text else nodes
    if low == high == nodes and int(restarts_text) == 0:
        return None
    return low, high, int(restarts_text)


def elastic_command(mode: str, run_id: str, elastic: "tuple[int, int, int]") -> List[str]:
    """distlib-run's elastic flags for ``mode`` (module docstring)."""
    low, high, restarts = elastic
    nodes = f"{low}:{high}"
    cmd = ["--nnodes", nodes, "--max-restarts", str(restarts), "--rdzv-backend", "c10d"]
    rdzv_conf = os.environ.get("RDZV_CONF", "").strip()
    if rdzv_conf:
        cmd += ["--rdzv-conf", rdzv_conf]
    if mode == "tcp":
        endpoint = os.environ.get("MASTER_ENDPOINT", "master:29500")
        log(f"elastic (--nnodes {nodes}, --max-restarts {restarts}): rounds on the master service at {endpoint}")
        return cmd + ["--rdzv-endpoint", endpoint]
    if mode in ("file", "nfs"):
        shared = os.environ.get("SHARED_DIR", "/shared").rstrip("/") or "/shared"
        log(f"elastic (--nnodes {nodes}, --max-restarts {restarts}): rounds on the FileStore "
            f"{shared}/{run_id}/rdzv")
        return cmd + ["--rdzv-endpoint", f"file://{shared}/{run_id}/rdzv"]
    raise ToolError(f"MIN_NODES/MAX_RESTARTS (an elastic job) need MODE=tcp, file or nfs, not {mode}: rank0 means "
                    "node 0 hosts the store, and a lost node 0 would take it along")


def default_job_elastic_args(run_id: str) -> List[str]:
    """The default job's checkpoint (on the volume every worker mounts) and pace when elastic."""
    every = os.environ.get("CHECKPOINT_EVERY", "").strip() or "10"
    args = ["--checkpoint", f"/workspace/checkpoints/{run_id}/train_dp.npz", "--checkpoint-every", every]
    pace = os.environ.get("STEP_SECONDS", "").strip()
    return args + (["--step-seconds", pace] if pace else [])


def build_command(argv: List[str]) -> List[str]:
    mode = deploy_settings.cluster_mode()
    nodes = int(os.environ.get("NODES", "1"))
    nproc = os.environ.get("NPROC_PER_NODE", "1")
    run_id = settings.text("DISTLIB_RUN_ID")
    if not run_id:
        raise ToolError("DISTLIB_RUN_ID is not set (distlib cluster up sets a new one for every run)")
    service = os.environ.get("CLUSTER_SERVICE", "worker")
    program = program_from_env(argv)
    if os.environ.get("JOB", "").strip():
        log(f"your job: {' '.join(shlex.quote(w) for w in program)} in {os.getcwd()}")
    dns_timeout = float(os.environ.get("CLUSTER_DNS_TIMEOUT", "120"))
    elastic = elastic_settings()
    if elastic is not None:
        if os.environ.get("CLUSTER_GPUS_PER_NODE", "").strip():
            raise ToolError("GPU=1 with MIN_NODES/MAX_RESTARTS: the Compose cluster gives each worker its GPUs by its "
                            "position among NODES containers, which an elastic job does not have; run it without GPU=1")
        if not os.environ.get("JOB", "").strip() and program[:2] == ["-m", DEFAULT_JOB_MODULE]:
            program = program + default_job_elastic_args(run_id)
        cmd = ["distlib-run", "--nproc-per-node", nproc, "--run-id", run_id]
        return cmd + elastic_command(mode, run_id, elastic) + program
    cmd = ["distlib-run", "--nnodes", str(nodes), "--nproc-per-node", nproc, "--run-id", run_id]
    slot: Optional[int] = None
    if mode == "tcp":
        endpoint = os.environ.get("MASTER_ENDPOINT", "master:29500")
        cmd += ["--node-rank", "auto", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        log(f"mode tcp: node rank from the master service at {endpoint} (--node-rank auto)")
    elif mode == "rank0":
        rank, addresses = rank_by_dns(service, nodes, dns_timeout)
        slot = rank
        port = os.environ.get("MASTER_PORT", "29500")
        cmd += ["--node-rank", str(rank), "--rdzv-backend", "static",
                "--master-addr", addresses[0], "--master-port", port]
        log(f"mode rank0: node rank {rank} of {nodes} (address {addresses[rank]} among {', '.join(addresses)}); "
            f"node 0 ({addresses[0]}:{port}) hosts the store")
    elif mode in ("file", "nfs"):
        rank, addresses = rank_by_dns(service, nodes, dns_timeout)
        slot = rank
        shared = os.environ.get("SHARED_DIR", "/shared").rstrip("/") or "/shared"
        url = f"file://{shared}/{run_id}/store"
        try:  # the run's directory: FileStore creates its file, not the directories above it
            os.makedirs(f"{shared}/{run_id}", exist_ok=True)
        except OSError as exc:
            raise ToolError(f"cannot create the run's directory {shared}/{run_id} on the shared volume: {exc}") from None
        os.environ["DISTLIB_INIT_METHOD"] = url
        # The job meets through the FileStore (init_process_group() without an init_method takes
        # DISTLIB_INIT_METHOD); MASTER_ADDR is node 0 all the same, so that a script that asks
        # for env:// explicitly reaches a store rank 0 hosts there, not its own loopback.
        port = os.environ.get("MASTER_PORT", "29500")
        cmd += ["--node-rank", str(rank), "--master-addr", addresses[0], "--master-port", port]
        log(f"mode {mode}: node rank {rank} of {nodes} (address {addresses[rank]} among {', '.join(addresses)}); "
            f"FileStore {url[len('file://'):]} (DISTLIB_INIT_METHOD); MASTER_ADDR {addresses[0]}:{port} for env://")
    else:
        raise ToolError(f"unknown DISTLIB_CLUSTER_MODE={mode!r}: tcp, rank0, file or nfs")
    assign_gpus(service, nodes, dns_timeout, slot)
    return cmd + program


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]

    def start() -> int:
        cmd = build_command(argv)
        log("exec " + " ".join(shlex.quote(c) for c in cmd))
        os.execvp(cmd[0], cmd)
        return 127  # not reached

    return run("compose_node", start)


if __name__ == "__main__":
    sys.exit(main())
