"""One rank of a MODE=mpi job, with a record of how it ended.

    mpirun ... python -m distlib_deploy.jobs.mpi_rank [--record-dir DIR] -- python -m distlib_deploy.jobs.train_dp ...

Why: when a rank dies, mpirun often cannot say which. Its peers lose their TCP connections to
the dead rank at once, and the first to notice calls MPI_Abort ("An error occurred in Socket
closed ... MPI_ERRORS_ARE_FATAL"); mpirun then reports *that* rank ("prterun has exited due
to process rank 0 ... calling abort") and never mentions the killed one. So each rank runs
under this small parent, which waits for it and writes, in its own container, when and how it
ended (``RECORD_DIR/rank-<R>.json``: rank, host, pid, exit status or signal, time). `distlib
cluster up` reads the workers' records after a failed run: the first rank to end abnormally is
the failing side, whatever mpirun printed (the containers share the host's clock).

The parent stays out of the way: the rank inherits everything (environment, PMIx connection
variables, stdin/stdout/stderr; plus torch's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from
Open MPI's, for scripts written for torchrun), signals mpirun's daemon sends are passed on, the rank is
killed if the parent dies (PR_SET_PDEATHSIG), and the parent ends as the rank ended (the same
exit status, or the same signal), so mpirun sees what it would have seen without it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional

PREFIX = "mpi_rank:"
#: Where each worker container keeps the records of its ranks (its own file system: `distlib
#: cluster up` copies them out through the engine's API).
RECORD_DIR = "/tmp/distlib-mpi-ranks"
#: Signals mpirun's daemon may send a rank (abort, suspend, resume, its own uses): passed on.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGTSTP, signal.SIGCONT)
_PR_SET_PDEATHSIG = 1


def world_rank(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """This process's rank in MPI_COMM_WORLD as the launcher set it (Open MPI, PMIx, MPICH)."""
    env = os.environ if env is None else env
    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


#: torch's variables, from Open MPI's (a script written for torchrun reads these).
_FROM_MPI = {"RANK": "OMPI_COMM_WORLD_RANK", "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
             "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE"}


def torch_env(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from MPI's variables, where not already set:
    so a user's unmodified ``init_process_group("gloo")`` (env://, with the MASTER_ADDR mpirun
    passes on) works under mpirun as under torchrun."""
    env = os.environ if env is None else env
    return {name: env[mpi] for name, mpi in _FROM_MPI.items() if not env.get(name) and env.get(mpi, "").isdigit()}


def describe(returncode: int) -> str:
    """``exited with status 3`` / ``killed by signal 9 (SIGKILL)`` for a Popen return code."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "?"
    return f"killed by signal {-returncode} ({name})"


def record(directory: Path, rank: Optional[int], pid: int, returncode: int, ended: float) -> Path:
    """Write how a rank ended (atomically); returns the file."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"rank-{rank if rank is not None else 'unknown'}-{pid}.json"
    data = {"rank": rank, "host": socket.gethostname(), "pid": pid,
            "status": returncode if returncode >= 0 else None,
            "signal": -returncode if returncode < 0 else None,
            "what": describe(returncode), "time": ended}
    tmp = directory / f".{name}.tmp"
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, directory / name)
    return directory / name


def _die_with_parent() -> None:
    """In the child: be killed when the parent dies (the parent may be SIGKILLed by mpirun's
    daemon, which would otherwise leave the rank running)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def run(program: List[str], directory: Path) -> int:
    """Run ``program``, pass signals on, record how it ended; the return code (negative: the
    signal that killed it)."""
    parent = os.getpid()

    def setup() -> None:
        _die_with_parent()
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    child = subprocess.Popen(program, preexec_fn=setup, env={**os.environ, **torch_env()})  # noqa: PLW1509
    for signum in FORWARDED:
        signal.signal(signum, lambda s, _frame: child.send_signal(s))
    returncode = child.wait()
    ended = time.time()
    rank = world_rank()
    try:
        record(directory, rank, child.pid, returncode, ended)
    except OSError as exc:
        sys.stderr.write(f"{PREFIX} rank {rank}: could not record how it ended in {directory}: {exc}\n")
    if returncode != 0:
        sys.stderr.write(f"{PREFIX} rank {rank} on {socket.gethostname()} (pid {child.pid}) {describe(returncode)}\n")
        sys.stderr.flush()
    return returncode


def end_as(returncode: int) -> None:
    """End this process as the rank ended: the same signal, or the same exit status."""
    if returncode < 0:
        signum = -returncode
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        time.sleep(1)  # a signal that does not end a process (SIGCONT ...): exit below
        returncode = 128 + signum
    sys.exit(returncode)


USAGE = "usage: python -m distlib_deploy.jobs.mpi_rank [--record-dir DIR] -- PROGRAM [ARGS...]"


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    directory = RECORD_DIR
    if argv[:1] == ["--record-dir"] and len(argv) > 1:
        directory, argv = argv[1], argv[2:]
    if argv[:1] != ["--"] or len(argv) < 2:
        sys.stderr.write(f"{PREFIX} {USAGE}\n")
        return 2
    end_as(run(argv[1:], Path(directory)))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
