"""The pytest plugin (entry point ``pytest11: distlib_testing``): the ``distlib_cluster`` fixture,
the options, and what happens when a test with a fault schedule fails.

Fixtures
    distlib_cluster   factory: ``distlib_cluster(nodes=3, substrate=None, **options)`` -> Cluster,
                      closed after the test (every process, namespace, container, network).
    distlib_substrate the substrate this test runs on: the ``distlib_substrates`` marker's
                      parameter, else ``--distlib-substrate`` (default "processes").

Markers
    distlib_substrates("processes", "containers")  run the test once per substrate.

A test that cannot run here (no Docker engine; a fault this runner cannot make) is skipped with
one line saying why; ``--distlib-strict`` makes it fail instead (CI that must run it). When a
test that ran a fault schedule fails, the schedule is saved as JSON (``--distlib-schedules``)
and the path is shown; ``--distlib-replay FILE`` runs that test with the saved schedule, and
``--distlib-shrink`` reruns a failing test with fewer steps until no step can go.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, List, Optional

import pytest

from .cluster import Cluster, Unsupported, new_run_dir
from .schedule import Schedule, shrink

CLUSTERS = pytest.StashKey[List[Cluster]]()
#: the schedule that replaces each run's own in this test (--distlib-replay; shrinking's candidates)
REPLAY = pytest.StashKey[Optional[Schedule]]()
SUBSTRATES = ("processes", "containers")


class Unavailable(Exception):
    """The substrate cannot be had on this runner (no Docker engine)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("distlib", "distlib.testing: multi-host failure tests")
    group.addoption("--distlib-substrate", choices=SUBSTRATES, default=None,
                    help="substrate for tests that do not choose one (default: processes)")
    group.addoption("--distlib-strict", action="store_true", default=False,
                    help="a test that cannot run here (no Docker, a fault this runner cannot make) fails "
                         "instead of skipping")
    group.addoption("--distlib-image", default=None,
                    help="image of the container substrate's hosts (default: distlib:cpu)")
    group.addoption("--distlib-schedules", default=".distlib-testing/schedules",
                    help="directory where the schedules of failing tests are saved (a CI artefact)")
    group.addoption("--distlib-replay", default=None, metavar="FILE",
                    help="a saved schedule: the test it names runs with it instead of its own")
    group.addoption("--distlib-shrink", action="store_true", default=False,
                    help="rerun a failing test with fewer fault steps until none can be removed; save that")
    parser.addini("distlib_substrate", "default substrate (processes or containers)", default="processes")
    parser.addini("distlib_image", "image of the container substrate's hosts", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "distlib_substrates(*names): run the test once per substrate "
                                       "(processes, containers) with the distlib_cluster fixture")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("distlib_substrates")
    if marker is None or "distlib_substrate" not in metafunc.fixturenames:
        return
    names = list(marker.args) or list(SUBSTRATES)
    unknown = [n for n in names if n not in SUBSTRATES]
    if unknown:
        raise pytest.UsageError(f"distlib_substrates: unknown substrate(s) {unknown} (known: {', '.join(SUBSTRATES)})")
    metafunc.parametrize("distlib_substrate", names, indirect=True)


@pytest.fixture
def distlib_substrate(request: pytest.FixtureRequest) -> str:
    param = getattr(request, "param", None)
    if param:
        return str(param)
    return request.config.getoption("--distlib-substrate") or request.config.getini("distlib_substrate") or "processes"


def _unavailable(config: pytest.Config, reason: str) -> None:
    if config.getoption("--distlib-strict"):
        pytest.fail(f"{reason} (--distlib-strict)", pytrace=False)
    pytest.skip(reason)


def _replay(config: pytest.Config, nodeid: str) -> Optional[Schedule]:
    path = config.getoption("--distlib-replay")
    if not path:
        return None
    data = json.loads(Path(path).read_text())
    return Schedule.from_json(data) if data.get("test") in (None, nodeid) else None


@pytest.fixture
def distlib_cluster(request: pytest.FixtureRequest, distlib_substrate: str) -> Iterator[Callable[..., Cluster]]:
    """Factory of clusters for this test (module docstring)."""
    made: List[Cluster] = []
    request.node.stash[CLUSTERS] = made
    config = request.config
    request.node.stash[REPLAY] = _replay(config, request.node.nodeid)

    def make(nodes: int = 3, substrate: Optional[str] = None, project_dir: Optional[str] = None,
             **options: Any) -> Cluster:
        kind = substrate or distlib_substrate
        run_dir = new_run_dir()
        project = os.path.abspath(project_dir or str(config.rootpath))
        if kind == "containers":
            from .containers import ContainerSubstrate, DockerUnavailable

            options.setdefault("image", config.getoption("--distlib-image") or config.getini("distlib_image") or None)
            try:
                sub: Any = ContainerSubstrate(run_dir, project, **options)
            except DockerUnavailable as exc:
                _unavailable(config, str(exc))
        elif kind == "processes":
            from .processes import ProcessSubstrate

            sub = ProcessSubstrate(run_dir, **options)
        else:
            raise ValueError(f"substrate must be one of {', '.join(SUBSTRATES)}, not {kind!r}")
        cluster = Cluster(sub, nodes, run_dir, project)
        cluster.replay = request.node.stash.get(REPLAY, None)
        made.append(cluster)
        return cluster

    yield make
    errors = []
    for cluster in made:
        try:
            cluster.close()
        except Exception as exc:  # noqa: BLE001 - every cluster is closed; the first error is raised after
            errors.append(exc)
    if errors:
        raise errors[0]


def _schedule_path(config: pytest.Config, nodeid: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:150]
    return Path(config.getoption("--distlib-schedules")) / f"{safe}.json"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    except Unsupported as exc:
        _unavailable(item.config, str(exc))
    except BaseException as failure:
        clusters = item.stash.get(CLUSTERS, [])
        ran = [s for c in clusters for s in c.schedules if len(s)]
        if ran and item.config.getoption("--distlib-shrink") and isinstance(failure, Exception):
            smallest = _shrink(item, ran[-1], failure)
            path = smallest.save(_schedule_path(item.config, item.nodeid).with_suffix(".shrunk.json"),
                                 test=item.nodeid)
            item.add_report_section("call", "distlib.testing", f"shrunk to {len(smallest)} step(s): {path}\n"
                                                             f"{smallest}")
        raise


def failure_kind(exc: BaseException) -> str:
    """What makes two failures the same for shrinking: the exception's type and its message's
    headline (before the first colon, digits left out: ports and pids differ between runs)."""
    headline = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {re.sub(r'[0-9]+', '#', headline.split(':', 1)[0])}"


def _shrink(item: pytest.Item, schedule: Schedule, original: BaseException) -> Schedule:
    wanted = failure_kind(original)

    def fails(candidate: Schedule) -> bool:
        item.stash[REPLAY] = candidate
        try:
            item.runtest()
        except (AssertionError, pytest.fail.Exception) as exc:
            return failure_kind(exc) == wanted  # the same failure persists (another one is another bug)
        except Exception:  # noqa: BLE001 - anything else (a skip, a harness error) is another outcome
            return False
        return False

    try:
        return shrink(schedule, fails)
    finally:
        item.stash[REPLAY] = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    if call.when == "call" and report.failed:
        ran = [s for c in item.stash.get(CLUSTERS, []) for s in c.schedules if len(s)]
        if ran:
            path = ran[-1].save(_schedule_path(item.config, item.nodeid), test=item.nodeid)
            report.sections.append(("distlib.testing", f"fault schedule saved: {path} (rerun it: "
                                                       f"pytest '{item.nodeid}' --distlib-replay {path})"))
    return report
