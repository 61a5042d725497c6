"""The MPI tests need mpi4py, an MPI library and mpirun. Without them they skip, saying what is
missing, unless DISTLIB_REQUIRE_MPI=1 (CI: `make test` installs the `mpi` extra), which makes
that a failure. Each suite runs once per world size (one mpirun each) and is shared by every
test that reads it."""

import pytest

from tests.support import settings

from .launch import mpirun_path, run_job

WORLD_SIZES = [1, 2, 3, 4]
#: Wall-clock bound of one suite's launch (it takes 2-15 s here).
SUITE_TIMEOUT = 300


def _missing() -> str:
    from distlib.backends.mpi import runtime as mpi_runtime

    if not mpi_runtime.available():
        return mpi_runtime.unavailable_reason()
    if mpirun_path() is None:
        return "mpirun is not on PATH nor next to the Python interpreter"
    return ""


@pytest.fixture(scope="session")
def mpi_ready():
    missing = _missing()
    if missing:
        if settings.require_mpi():
            pytest.fail(f"DISTLIB_REQUIRE_MPI is set but the MPI tests cannot run: {missing}")
        pytest.skip(f"no MPI: {missing}")


@pytest.fixture(scope="session")
def suites(mpi_ready, tmp_path_factory):
    """``suites(name, ranks)``: that suite's finished job (run on first use, then cached)."""
    done = {}

    def get(name: str, ranks: int):
        if (name, ranks) not in done:
            done[name, ranks] = run_job(ranks, name, tmp_path_factory.mktemp(f"{name}-ws{ranks}"), SUITE_TIMEOUT)
        return done[name, ranks]

    return get


@pytest.fixture(params=WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def matrix(request, suites):
    """The matrix suite's job at each world size."""
    return suites("matrix", request.param)
