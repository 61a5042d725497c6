"""distlib.testing: run your distributed job on N hosts in CI and break them on cue.

A pytest plugin (registered by entry point: ``pip install "distlib-c10d[testing]"`` and the
``distlib_cluster`` fixture is there) and the library under it. Hosts are processes with their
own network namespace and name (or containers, through the docker SDK); a master service the
harness runs is the job's store; faults fire on events (rank r enters collective #k, a store
operation, a line of output), never on the clock. docs/testing.md is the guide.

Nothing here is imported by ``import distlib``; the docker SDK is imported only when the
container substrate is used.
"""

from __future__ import annotations

from . import cues, faults
from .cluster import Cluster, Unsupported, new_run_dir
from .job import Job
from .record import HostRecord, RankRecord, Result
from .schedule import Schedule, Step, shrink

__all__ = ["Cluster", "Job", "Result", "RankRecord", "HostRecord", "Schedule", "Step", "Unsupported", "cues",
           "faults", "shrink", "new_run_dir", "make_cluster"]


def make_cluster(nodes: int, substrate: str = "processes", run_dir: str | None = None,
                 project_dir: str | None = None, **options: object) -> Cluster:
    """A cluster of ``nodes`` hosts on ``substrate`` ("processes" or "containers"); close it
    after (``with make_cluster(...) as c``). ``options`` go to the substrate (containers:
    ``image``, ``client``; processes: ``namespaces``)."""
    run_dir = run_dir or new_run_dir()
    project = project_dir or __import__("os").getcwd()
    if substrate == "processes":
        from .processes import ProcessSubstrate

        return Cluster(ProcessSubstrate(run_dir, **options), nodes, run_dir, project)  # type: ignore[arg-type]
    if substrate == "containers":
        from .containers import ContainerSubstrate

        return Cluster(ContainerSubstrate(run_dir, project, **options), nodes, run_dir, project)  # type: ignore[arg-type]
    raise ValueError(f"substrate must be 'processes' or 'containers', not {substrate!r}")
