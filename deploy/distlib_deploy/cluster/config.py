"""What a cluster run is made of: the settings (the Makefile's variables, read from the
environment), checked before anything starts, and the Compose files and variables they give.

Bad input is a ToolError with exit status 2 that names the variable and what it accepts.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional

from distlib import settings
from distlib.store.tcp.journal import SYNC_MODES

from distlib.command import ToolError
from ..jobs.compose_node import DEFAULT_JOB_MODULE, job_program
from . import slurm
from .auth_token import TOKEN_FILE
from .elastic import COMPOSE_FILE as ELASTIC_FILE, ElasticCluster

MODES = ("tcp", "rank0", "file", "nfs", "mpi", "slurm")
DEFAULT_IMAGE = "distlib:cpu"
#: GPU=1's image: what `make image-gpu` builds (docker/Dockerfile, target cuda).
DEFAULT_GPU_IMAGE = "distlib:cuda"
DEFAULT_NODES = 4
DEFAULT_TIMEOUT_S = 900.0
#: Labels on everything a run creates (the Compose files set them).
LABEL = "org.distlib.cluster"
OWNER_LABEL = f"{LABEL}.owner"
#: A run id names the Compose project, the store keys and the FileStore's directory.
RUN_ID = re.compile(r"[a-z0-9][a-z0-9-]*")
#: Variables the Compose files interpolate, passed on from the caller's environment as they are.
PASSED_ON = ("NFS_VERSION", "NFS_OPTIONS", "NFS_HOST_PORT", "NFS_IMAGE", "DISTLIB_LOG_LEVEL", "NCCL_DEBUG",
             "MASTER_SYNC")


def find_root(start: Optional[Path] = None) -> Path:
    """The checkout holding compose/docker-compose.yml: above this package (an editable
    install), else above the current directory."""
    for base in (Path(__file__).resolve(), Path(start or os.getcwd()).resolve()):
        for candidate in (base, *base.parents):
            if (candidate / "compose" / "docker-compose.yml").is_file():
                return candidate
    raise ToolError("cannot find compose/docker-compose.yml: run `distlib cluster` in a distlib checkout "
                    "(make cluster-up does)")


def _positive_int(env: Mapping[str, str], name: str, default: int, what: str) -> int:
    text = env.get(name, "").strip() or str(default)
    if not text.isdigit() or int(text) < 1:
        raise ToolError(f"{name}={text}: {what}", 2)
    return int(text)


def project_name(run_id: str) -> str:
    """The Compose project of a run (it names the containers, network and volumes)."""
    return f"distlib-{run_id}"


def new_run_id() -> str:
    """``r<date>-<time>-<6 hex>``: new for every run, sortable by start time."""
    return f"r{dt.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


@dataclass
class Settings:
    """One `distlib cluster` invocation's settings (docs/cluster.md lists them)."""

    root: Path
    mode: str = "tcp"
    nodes: int = DEFAULT_NODES
    nproc_per_node: int = 1
    image: str = DEFAULT_IMAGE
    gpu: bool = False
    #: AUTH (default on): a new token per run that the master, every rank and the store require.
    auth: bool = True
    skip_build: bool = False
    quiet: bool = False
    job: str = ""
    job_dir: str = ""
    job_args: str = ""
    job_module: str = DEFAULT_JOB_MODULE
    nfs_server: str = ""
    nfs_path: str = ""
    compose: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    state_dir: Path = field(default_factory=Path)
    run_id: str = ""
    passed_on: Dict[str, str] = field(default_factory=dict)
    #: MIN_NODES/MAX_RESTARTS: an elastic job (elastic.py), else None.
    elastic: Optional[ElasticCluster] = None

    @classmethod
    def from_env(cls, root: Path, env: Optional[Mapping[str, str]] = None) -> "Settings":
        env = os.environ if env is None else env
        mode = env.get("MODE", "").strip() or "tcp"
        if mode not in MODES:
            raise ToolError(f"MODE={mode}: choose {', '.join(MODES[:-1])} or {MODES[-1]} (docs/cluster.md)", 2)
        nfs_server, nfs_path = env.get("NFS_SERVER", "").strip(), env.get("NFS_PATH", "").strip()
        if mode == "file" and bool(nfs_server) != bool(nfs_path):
            raise ToolError("set both NFS_SERVER and NFS_PATH (the NFS export for the shared volume), or neither", 2)
        timeout_text = env.get("CLUSTER_TIMEOUT", "").strip() or f"{DEFAULT_TIMEOUT_S:g}"
        try:
            timeout_s = float(timeout_text)
        except ValueError:
            timeout_s = -1.0
        if not timeout_s > 0:
            raise ToolError(f"CLUSTER_TIMEOUT={timeout_text}: seconds the job may run, a positive number", 2)
        sync = env.get("MASTER_SYNC", "").strip()
        if sync and sync not in SYNC_MODES:  # (the master's store-server --sync)
            raise ToolError(f"MASTER_SYNC={sync}: turn (the journal synced before each loop turn's replies, the "
                            f"default) or none (written before them, synced by the OS) (docs/stores.md)", 2)
        run_id = env.get("RUN_ID", "").strip()
        if run_id and not RUN_ID.fullmatch(run_id):
            raise ToolError(f"RUN_ID={run_id}: lower-case letters, digits and '-' only (it names the Compose "
                            "project)", 2)
        try:
            skip_build = settings.flag("SKIP_BUILD", False, env)
            quiet = settings.flag("QUIET", False, env)
            gpu = settings.flag("GPU", False, env)
            auth = settings.flag("AUTH", True, env)
        except ValueError as exc:
            raise ToolError(str(exc), 2) from None
        state_dir = Path(env.get("CLUSTER_STATE_DIR", "").strip() or root / ".build" / "cluster").absolute()
        default_image = DEFAULT_GPU_IMAGE if gpu else slurm.DEFAULT_IMAGE if mode == "slurm" else DEFAULT_IMAGE
        if mode == "slurm":
            slurm.check(gpu)
        made = cls(
            root=root, mode=mode,
            nodes=_positive_int(env, "NODES", DEFAULT_NODES, "a positive number of worker containers"),
            nproc_per_node=_positive_int(env, "NPROC_PER_NODE", 1, "a positive number of processes per container"),
            image=env.get("IMAGE", "").strip() or default_image, gpu=gpu,
            auth=auth, skip_build=skip_build, quiet=quiet,
            job=env.get("JOB", "").strip(), job_dir=env.get("JOB_DIR", "").strip(),
            job_args=env.get("JOB_ARGS", ""), job_module=env.get("JOB_MODULE", "").strip() or DEFAULT_JOB_MODULE,
            nfs_server=nfs_server if mode == "file" else "", nfs_path=nfs_path if mode == "file" else "",
            compose=env.get("COMPOSE", "").strip(), timeout_s=timeout_s, state_dir=state_dir, run_id=run_id,
            passed_on={k: env[k] for k in PASSED_ON if env.get(k)},
        )
        made.elastic = ElasticCluster.from_env(env, made.nodes, mode)
        if made.job:
            made._check_job()
        return made

    def _check_job(self) -> None:
        """JOB runs on every worker with JOB_DIR (default: the current directory) mounted
        read-only as its working directory: the command must be Python's, the directory must
        exist and be readable by the image's user, and a script must be in it."""
        try:
            program = job_program(self.job)
        except ValueError as exc:
            raise ToolError(str(exc), 2) from None
        job_dir = Path(self.job_dir or os.getcwd()).absolute()
        if not job_dir.is_dir():
            raise ToolError(f"JOB_DIR={job_dir}: no such directory (the job's working directory)", 2)
        self.job_dir = str(job_dir)
        if program[0] != "-m" and not (job_dir / program[0]).exists():
            raise ToolError(f"JOB={self.job!r}: {program[0]} is not in {job_dir} (the current directory, or "
                            "JOB_DIR, is mounted as the job's working directory)", 2)
        mode = job_dir.stat().st_mode
        if os.getuid() != 1000 and (mode & 0o005) != 0o005:
            raise ToolError(f"JOB_DIR={job_dir} is not readable by others (mode {mode & 0o777:o}): the workers run "
                            "as uid 1000; chmod o+rx it (and o+r its files)", 2)

    # -- what Compose gets ------------------------------------------------------------------------

    @property
    def owner(self) -> str:
        """The owner label's value: this state directory's runs, so that `down` never touches
        clusters started from another checkout, or by the tests."""
        return hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:12]

    def compose_files(self) -> List[str]:
        d = self.root / "compose"
        files = [d / "docker-compose.yml", d / f"mode-{self.mode}.yml"]
        if self.mode == "file" and self.nfs_server:
            files.append(d / "nfs-volume.yml")
        if self.job:
            files.append(d / "job-dir.yml")
        if self.gpu:
            files.append(d / "gpu.yml")
        if self.elastic:
            files.append(d / ELASTIC_FILE)
        if self.auth:  # the token in every container that serves or joins the store
            files.append(d / "auth.yml")
            if self.mode == "tcp":
                files.append(d / "auth-master.yml")
            if self.mode == "mpi":
                files.append(d / "auth-launcher.yml")
        if self.mode == "slurm":
            files += slurm.compose_files(d, self.auth)
        return [str(f) for f in files]

    def ssh_dir(self, run_id: str) -> Path:
        """MODE=mpi: where the run's key pair lives (its directory under the state directory)."""
        return self.state_dir / project_name(run_id) / "ssh"

    def auth_dir(self, run_id: str) -> Path:
        """AUTH=1: where the run's token file lives (its directory under the state directory)."""
        return self.state_dir / project_name(run_id) / "auth"

    def compose_variables(self, run_id: str) -> Dict[str, str]:
        """The variables the Compose files interpolate, for this run."""
        out = {"RUN_ID": run_id, "IMAGE": self.image, "NODES": str(self.nodes),
               "NPROC_PER_NODE": str(self.nproc_per_node), "CLUSTER_OWNER": self.owner,
               "JOB_ARGS": self.job_args, "JOB_MODULE": self.job_module, "JOB": self.job}
        if self.job:
            out["JOB_DIR"] = self.job_dir
        if self.mode == "mpi":
            out["MPI_SSH_DIR"] = str(self.ssh_dir(run_id))
        if self.mode == "slurm":
            out.update(slurm.compose_variables(self.state_dir / project_name(run_id), self.job))
        if self.auth:  # the file's path only: the token itself is in no variable
            out["AUTH_TOKEN_FILE"] = str(self.auth_dir(run_id) / TOKEN_FILE)
        if self.nfs_server:
            out.update(NFS_SERVER=self.nfs_server, NFS_PATH=self.nfs_path)
        out.update(self.passed_on)
        out.update(self.elastic.compose_variables() if self.elastic else {})
        return out
