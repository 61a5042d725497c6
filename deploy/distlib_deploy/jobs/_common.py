"""What the jobs share: joining the default group from the environment, sizes, host facts.

The init method comes from ``DISTLIB_INIT_METHOD`` when it is set (the Helm chart's file mode
sets ``file:///shared/<run id>/store``; the Compose cluster's file mode the same), else
``env://`` (what ``distlib-run`` prepares: ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE``, and for the c10d backend ``TORCHELASTIC_USE_AGENT_STORE=True`` so that every
rank is a client of the master service). A ``file://`` URL without ``rank``/``world_size``
gets them from ``RANK``/``WORLD_SIZE``, and its directory is created first (FileStore refuses
a missing directory; on a fresh shared volume nobody else creates it).

A backend that runs NCCL (``nccl``, ``cpu:gloo,cuda:nccl``) binds the group to ``cuda:LOCAL_RANK``
(``device_id``; torch's jobs call ``torch.cuda.set_device(local_rank)``) and makes that device
cupy's current one; ``array_module`` then says the job's arrays are cupy's.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Dict, Mapping, Optional, Tuple
from urllib.parse import urlparse

from distlib import settings

from .. import settings as deploy_settings


def env_int(name: str) -> Optional[int]:
    value = os.environ.get(name, "").strip()
    return int(value) if value.lstrip("-").isdigit() else None


def env_int_or(name: str, default: int) -> int:
    """``env_int(name)``, or ``default`` where the variable is unset or not an integer."""
    value = env_int(name)
    return default if value is None else value


def init_method_from_env() -> str:
    return settings.init_method() or "env://"


def prepare_file_url(url: str) -> Tuple[str, int, int]:
    """For a ``file://`` URL: create its directory; return (url, rank, world_size) where rank
    and world_size are -1 when the URL carries them, else taken from RANK/WORLD_SIZE."""
    parsed = urlparse(url)
    query = parsed.query
    if parsed.path:
        os.makedirs(os.path.dirname(parsed.path) or "/", exist_ok=True)
    rank = world = -1
    if "rank=" not in query:
        rank = env_int_or("RANK", -1)
    if "world_size=" not in query:
        world = env_int_or("WORLD_SIZE", -1)
    return url, rank, world


def runs_nccl(backend: str) -> bool:
    """Whether ``backend`` (a name or a device map such as "cpu:gloo,cuda:nccl") uses NCCL."""
    return any(part.split(":")[-1].strip().lower() == "nccl" for part in backend.split(","))


def job_device(backend: str, env: Mapping[str, str], devices: Optional[int] = None) -> Optional[int]:
    """The GPU a job's process binds its group to: ``LOCAL_RANK`` (``SLURM_LOCALID`` in an srun
    step; 0 without either) when the backend runs NCCL, else None (a launcher starts one process per GPU of its node). With
    more processes than visible GPUs, LOCAL_RANK modulo their number (torch's fallback; ranks
    of one communicator sharing a GPU need NCCL_HOSTID, see docs/gpu.md). ``devices``: the
    visible GPUs (None: ask cupy; 0: none known, LOCAL_RANK as is)."""
    if not runs_nccl(backend):
        return None
    from distlib.identity import Identity

    local = Identity.read(env).local_rank or 0  # LOCAL_RANK, or SLURM_LOCALID in an srun step
    if devices is None:
        from distlib.backends import cupy_env

        devices = cupy_env.status().devices
    return local % devices if devices > 0 else local


#: What the jobs report as the init method of the mpi backend (it has none: mpirun says who is who).
MPI_INIT = "mpi"


def join(backend: Optional[str], timeout_s: float) -> Tuple[str, float]:
    """init_process_group from the environment; returns (init method, seconds it took). The
    mpi backend takes no init method: rank and world size come from MPI_COMM_WORLD."""
    import distlib as dist

    backend = backend or deploy_settings.job_backend()
    if backend == "mpi":
        started = time.monotonic()
        dist.init_process_group("mpi", timeout=timedelta(seconds=timeout_s))
        return MPI_INIT, time.monotonic() - started
    url = init_method_from_env()
    rank = world = -1
    if url.startswith("file://"):
        url, rank, world = prepare_file_url(url)
    device_id = job_device(backend, os.environ)
    started = time.monotonic()
    dist.init_process_group(backend, init_method=url, timeout=timedelta(seconds=timeout_s), rank=rank,
                            world_size=world, device_id=device_id)
    if device_id is not None:
        import cupy

        cupy.cuda.Device(device_id).use()
    return url, time.monotonic() - started


def array_module():
    """The module of the job's arrays: cupy when the default group runs NCCL, else numpy."""
    import distlib as dist

    if runs_nccl(str(dist.get_backend())):
        import cupy

        return cupy
    import numpy

    return numpy


def device_name() -> str:
    """``cuda:N`` (cupy's current device) when the default group runs NCCL, else ``cpu``."""
    import distlib as dist

    if runs_nccl(str(dist.get_backend())):
        import cupy

        return f"cuda:{cupy.cuda.runtime.getDevice()}"
    return "cpu"


def describe_init(url: str) -> str:
    """The init method in words, for the report. env://'s master is the one the group was made
    with (distlib.distributed.get_identity): under srun it comes from Slurm's variables, and
    init writes nothing back into os.environ."""
    if url == MPI_INIT:
        return "mpirun: rank and world size from MPI_COMM_WORLD (no store)"
    if url.startswith("env://"):
        from distlib.distributed import get_identity

        who = get_identity()
        where = f"{who.master_addr or '?'}:{who.master_port if who.master_port is not None else '?'}"
        return (f"env:// through the master service at {where}" if who.external_store
                else f"env:// with rank 0 hosting the store at {where}")
    if url.startswith("file://"):
        return f"file:// FileStore {urlparse(url).path}"
    return url


def dns_name(address: Optional[str]) -> str:
    """The name DNS gives ``address`` (Docker: the container's name, e.g. ``proj-worker-3``, from
    ``<container>.<network>``), or "-". Ask about a *peer's* address: for its own address a
    container's resolver answers from /etc/hosts with the bare host name."""
    if not address or address == "?":
        return "-"
    ip = address.rsplit(":", 1)[0].strip("[]") if address.count(":") == 1 or address.startswith("[") else address
    try:
        ipaddress.ip_address(ip)
        name = socket.gethostbyaddr(ip)[0]
    except (OSError, ValueError):
        return "-"
    return name.split(".", 1)[0] if not name[:1].isdigit() else name


def advertised_address(rank: int) -> Optional[str]:
    """``host:port`` this rank advertised to its peers (the gloo backend's published record)."""
    try:
        from distlib.distributed import get_default_group

        pg = get_default_group()
        for backend in pg.backends.values():
            records = getattr(backend, "records", None)
            if records:
                host, port = records[rank]["addresses"][0]
                return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    except Exception:  # noqa: BLE001 - the report says "?" instead
        return None
    return None


def interface_address() -> Optional[str]:
    """The address of this host on the interface GLOO_SOCKET_IFNAME names (the cluster network),
    or None: what a backend without published addresses (mpi) shows in the report."""
    ifname = (os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") or [""])[0].strip()
    if not ifname:
        return None
    try:
        from distlib.backends.gloo.transport.address import interface_address as address_of

        return address_of(ifname)
    except Exception:  # noqa: BLE001 - the report says "?" instead
        return None


def host_facts(rank: int, init_s: float) -> Dict[str, object]:
    """Where this rank runs. ``node_rank``/``local_rank`` are None where no launcher set them
    (GROUP_RANK, LOCAL_RANK: distlib-run does, mpirun does not): ``place`` fills them in."""
    address = advertised_address(rank) or interface_address()
    return {
        "rank": rank,
        "local_rank": env_int("LOCAL_RANK"),
        "node_rank": env_int("GROUP_RANK"),
        "host": socket.gethostname(),
        "address": address or "?",
        "pid": os.getpid(),
        "device": device_name(),
        "init_s": init_s,
    }


def place(facts) -> None:
    """Fill in each rank's missing node rank (hosts numbered in the order of their lowest rank)
    and local rank (its position among the ranks of its host), in place."""
    hosts: Dict[str, int] = {}
    seen: Dict[str, int] = {}
    for f in sorted(facts, key=lambda f: f["rank"]):
        node = hosts.setdefault(f["host"], len(hosts))
        local = seen.get(f["host"], 0)
        seen[f["host"]] = local + 1
        if f["node_rank"] is None:
            f["node_rank"] = node
        if f["local_rank"] is None:
            f["local_rank"] = local


def error_name(exc: BaseException) -> str:
    """The public name of an error: ``DistBackendError`` rather than a private subclass."""
    for cls in type(exc).__mro__:
        if not cls.__name__.startswith("_"):
            return cls.__name__
    return type(exc).__name__


def table(header, rows) -> str:
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def say(text: str, stream=None) -> None:
    """Print whole lines in one write (ranks of one node share stdout)."""
    stream = stream or sys.stdout
    stream.write(text if text.endswith("\n") else text + "\n")
    stream.flush()
