"""``MODE=slurm`` on the host side: the image, the run's munge key, the Compose files and
variables, and which rank failed by the job's output.

The cluster itself is compose/mode-slurm.yml (slurmctld and NODES slurmd containers of the
image distlib:slurm) and distlib_deploy.cluster.slurm_node in each container; `distlib cluster
up` waits for the controller, whose ``sbatch --wait`` ends with the job, then stops the nodes.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from distlib.command import ToolError

#: The image of MODE=slurm: distlib's with Slurm and munge (docker/build-slurm-image.sh).
DEFAULT_IMAGE = "distlib:slurm"
BUILD_SCRIPT = Path("docker") / "build-slurm-image.sh"
#: The service whose exit ends the job (its sbatch --wait).
CONTROLLER = "slurmctld"
KEY_FILE = "munge.key"
#: munge's key size (mungekey's default, 1024 bytes).
KEY_BYTES = 1024
#: The controller container's name ends so under Compose v2 and v1.
CONTROLLER_SUFFIXES = ("-slurmctld-1", "_slurmctld_1")

_SRUN_ERROR = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (.+)$")
_DEAD_RANK = re.compile(r"rank (\d+) died, was killed, or destroyed its process group")


def check(gpu: bool) -> None:
    """Settings MODE=slurm cannot run with (ToolError, status 2)."""
    if gpu:
        raise ToolError("GPU=1 with MODE=slurm is not supported: the Slurm image is built on distlib:cpu (no GPU "
                        "resources are configured in its slurm.conf)", 2)


def compose_files(compose_dir: Path, auth: bool) -> List[Path]:
    """The Compose files MODE=slurm adds to docker-compose.yml and mode-slurm.yml."""
    return [compose_dir / "auth-slurm.yml"] if auth else []


def key_dir(run_dir: Path) -> Path:
    return run_dir / "munge"


def make_key(directory: Path) -> Path:
    """A new random munge key for this run's cluster in ``directory`` (mode 700, file 600);
    slurm_node copies it to /etc/munge with munge's ownership in every container."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)
        path = directory / KEY_FILE
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(secrets.token_bytes(KEY_BYTES))
    except OSError as exc:
        raise ToolError(f"cannot write the run's munge key in {directory}: {exc} (CLUSTER_STATE_DIR must be "
                        "writable)") from None
    return path


def remove_keys(state_dir: Path) -> None:
    """Delete the munge keys of the runs under ``state_dir`` (their containers are gone)."""
    for directory in state_dir.glob("*/munge"):
        shutil.rmtree(directory, ignore_errors=True)


def compose_variables(run_dir: Path, job: str) -> Dict[str, str]:
    """The variables mode-slurm.yml interpolates: the key's path, the tasks' directory."""
    return {"MUNGE_KEY_FILE": str(key_dir(run_dir) / KEY_FILE), "JOB_WORKDIR": "/job" if job else "/workspace"}


def blame(log: str) -> Optional[str]:
    """The failing rank by the controller's log (the job's output), in words, or None.

    A rank that distlib's errors name as dead comes first (the others failed because of it);
    else the first task srun reports killed by a signal; else the first srun error.
    """
    lines = log.splitlines()
    srun = []
    for line in lines:
        match = _SRUN_ERROR.search(line)
        if match:
            srun.append((match.group(1), _tasks(match.group(2)), match.group(3).strip()))
    dead = next((int(m.group(1)) for m in map(_DEAD_RANK.search, lines) if m), None)
    if dead is not None:
        said = next(((node, what) for node, tasks, what in srun if dead in tasks), None)
        where = f" on {said[0]}; srun: {said[1]}" if said else ""
        return f"rank {dead} (task {dead} of the step{where}), which the other ranks found dead"
    for node, tasks, what in srun:
        if not what.startswith("Exited with exit code"):
            return f"task{'s' if len(tasks) > 1 else ''} {_ranges(tasks)} on {node}: {what} (srun)"
    if srun:
        node, tasks, what = srun[0]
        return f"task{'s' if len(tasks) > 1 else ''} {_ranges(tasks)} on {node}: {what} (srun)"
    return None


def _tasks(text: str) -> List[int]:
    out: List[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def _ranges(tasks: Sequence[int]) -> str:
    """``[0, 1, 3]`` → ``0-1,3`` (as srun writes them)."""
    parts: List[str] = []
    start = prev = tasks[0]
    for task in list(tasks[1:]) + [None]:
        if task is not None and task == prev + 1:
            prev = task
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        if task is not None:
            start = prev = task
    return ",".join(parts)
