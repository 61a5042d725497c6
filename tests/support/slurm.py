"""A real Slurm 22.05 cluster in containers, for tests: slurmctld and N slurmd nodes.

Fixtures (tests/containers/conftest.py offers them to the container tests):
    slurm_image    (session) the Slurm image (docker/slurm/Dockerfile) on the session's distlib
                   image: built by docker/build-slurm-image.sh (seconds when up to date), or the
                   image named by DISTLIB_TEST_SLURM_IMAGE (then nothing is built).
    slurm_cluster  (module) a 2-node cluster, up and idle; removed after the module.

The containers run what `MODE=slurm make cluster-up` runs (distlib_deploy.cluster.slurm_node):
every node answers to the DNS name ``worker`` on an internal network (no route out), the
controller is ``slurmctld``; a munge key is made for the cluster here (never the package's);
a volume shared by all is mounted at /shared (a cluster's shared file system: job scripts go
there). Jobs run as the image's user, ``distlib``, from the controller (the login node).
Everything carries the test labels (tests/fixtures/docker.py sweeps what a crash leaves).
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import tarfile
import time
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import pytest

from tests.fixtures.docker import REPO_ROOT, SESSION_ID, labelled
from tests.support.lanes import unavailable

SLURM_IMAGE_ENV = "DISTLIB_TEST_SLURM_IMAGE"
BUILD_SCRIPT = REPO_ROOT / "docker" / "build-slurm-image.sh"
BUILD_LOG = REPO_ROOT / ".build" / "test-build-slurm-image.log"
UP_TIMEOUT_S = 120


def slurm_image_tag(distlib_image: str) -> str:
    """The Slurm image built on ``distlib_image``: distlib:slurm on distlib:cpu, else
    ``<distlib image>-slurm`` (so that an engineer's own tag never touches another's)."""
    return "distlib:slurm" if distlib_image == "distlib:cpu" else f"{distlib_image}-slurm"


def build_slurm_image(distlib_image: str) -> str:
    import subprocess

    tag = slurm_image_tag(distlib_image)
    env = dict(os.environ, IMAGE=tag, DISTLIB_IMAGE=distlib_image, SKIP_DISTLIB_IMAGE="1")
    BUILD_LOG.parent.mkdir(parents=True, exist_ok=True)
    with open(BUILD_LOG, "wb") as log:
        try:
            done = subprocess.run(["bash", str(BUILD_SCRIPT)], cwd=REPO_ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=900)
        except subprocess.TimeoutExpired:
            pytest.fail(f"docker/build-slurm-image.sh ran past 900 s (log: {BUILD_LOG})", pytrace=False)
    if done.returncode != 0:
        tail = BUILD_LOG.read_text(errors="replace").splitlines()[-20:]
        pytest.fail(f"IMAGE={tag} docker/build-slurm-image.sh failed (log: {BUILD_LOG}):\n" + "\n".join(tail),
                    pytrace=False)
    return tag


class SlurmCluster:
    """A running cluster: ``controller`` and ``nodes`` (docker-py containers); ``names`` the
    Slurm node names (node01 ...), in the order of ``nodes``."""

    def __init__(self, client, image: str, nodes: int, key_dir: Path):
        self.client = client
        self.image = image
        self.count = nodes
        self.tag = f"slurm-{SESSION_ID}-{secrets.token_hex(3)}"
        self.key = key_dir / "munge.key"
        self.network = None
        self.volume = None
        self.nodes: List[Any] = []
        self.names: List[str] = []
        self.controller = None
        self.up_s = 0.0

    # -- start / stop --------------------------------------------------------------------------

    def start(self) -> "SlurmCluster":
        self.key.write_bytes(secrets.token_bytes(1024))  # this cluster's key, as cluster up makes it
        self.key.chmod(0o600)
        self.network = self.client.networks.create(self.tag, driver="bridge", internal=True, labels=labelled())
        self.volume = self.client.volumes.create(name=f"{self.tag}-shared", labels=labelled())
        started = time.monotonic()
        common = dict(image=self.image, detach=True, init=True, labels=labelled(), environment={"NODES": str(self.count)},
                      volumes={str(self.key): {"bind": "/run/secrets/distlib/munge.key", "mode": "ro"},
                               self.volume.name: {"bind": "/shared", "mode": "rw"}},
                      network=self.network.name, shm_size="256m")
        for i in range(self.count):
            container = self.client.containers.create(command=["python", "-m", "distlib_deploy.cluster.slurm_node", "node"],
                                                      name=f"{self.tag}-node{i}", **common)
            self._alias(container, ["worker"])
            container.start()
            self.nodes.append(container)
        self.controller = self.client.containers.create(
            command=["python", "-m", "distlib_deploy.cluster.slurm_node", "controller"], name=f"{self.tag}-ctld",
            hostname="slurmctld", **common)
        self._alias(self.controller, ["slurmctld"])
        self.controller.start()
        self._wait_up(started)
        self.exec(["chmod", "1777", "/shared"], user="root")
        self._first_step()
        return self

    def _first_step(self, tries: int = 3) -> None:
        """A step on every node whose output comes back whole, before the tests' steps. The
        first step of a fresh cluster has lost its output once in CI (srun: "io_init_msg_unpack:
        unpack error", the tasks ran; Slurm 22.05's I/O forwarding, not distlib): a failed try
        is logged and retried, and three failures fail the fixture with their output."""
        outputs = []
        for _ in range(tries):
            code, out = self.exec(["srun", f"-N{self.count}", f"-n{self.count}", "hostname"])
            if code == 0 and "error" not in out and len(out.split()) == self.count:
                return
            outputs.append(f"exit {code}: {out.strip()}")
            print(f"slurm fixture: the first step's output did not come back whole, again: {outputs[-1]}")
        pytest.fail("no step of the fresh Slurm cluster returned its output whole:\n" + "\n".join(outputs),
                    pytrace=False)

    def _alias(self, container, aliases: Sequence[str]) -> None:
        self.network.disconnect(container)
        self.network.connect(container, aliases=list(aliases))

    def _wait_up(self, started: float) -> None:
        deadline = started + UP_TIMEOUT_S
        while time.monotonic() < deadline:
            self.controller.reload()
            logs = self.controller.logs().decode("utf-8", "replace")
            if "Slurm cluster up:" in logs:
                self.up_s = time.monotonic() - started
                break
            if self.controller.status == "exited":
                pytest.fail(f"the Slurm controller exited:\n{logs}\n{self._node_logs()}", pytrace=False)
            time.sleep(0.25)
        else:
            pytest.fail(f"the Slurm cluster was not up after {UP_TIMEOUT_S} s:\n"
                        f"{self.controller.logs().decode(errors='replace')}\n{self._node_logs()}", pytrace=False)
        # node k of `nodes` is the one whose address comes k-th: ask each for its Slurm name
        for container in self.nodes:
            code, out = container.exec_run(["sh", "-c", "grep -w \"$(hostname -i)\" /etc/hosts | awk '{print $2}'"])
            self.names.append(out.decode().split()[-1] if code == 0 and out.split() else "?")

    def _node_logs(self) -> str:
        return "\n".join(f"--- {c.name}:\n{c.logs().decode('utf-8', 'replace')[-3000:]}" for c in self.nodes)

    def close(self) -> None:
        for container in [self.controller, *self.nodes]:
            if container is not None:
                with contextlib.suppress(Exception):
                    container.remove(force=True, v=True)
        if self.network is not None:
            with contextlib.suppress(Exception):
                self.network.remove()
        if self.volume is not None:
            with contextlib.suppress(Exception):
                self.volume.remove(force=True)

    # -- using it ------------------------------------------------------------------------------

    def exec(self, argv: Sequence[str], user: str = "distlib", container=None,
             workdir: str = "/shared") -> Tuple[int, str]:
        """Run ``argv`` (no shell) in the controller (or ``container``): (exit code, output)."""
        target = container or self.controller
        code, out = target.exec_run(list(argv), user=user, workdir=workdir)
        return int(code), out.decode("utf-8", "replace")

    def node(self, name: str):
        return self.nodes[self.names.index(name)]

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write ``text`` to ``path`` under /shared (seen by every container)."""
        data = text.encode()
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            info = tarfile.TarInfo(os.path.basename(path))
            info.size, info.mode, info.uid, info.gid = len(data), mode, 1000, 1000
            tar.addfile(info, io.BytesIO(data))
        assert self.controller.put_archive(os.path.dirname(path), buffer.getvalue())

    def read(self, path: str) -> Optional[str]:
        code, out = self.exec(["cat", path])
        return out if code == 0 else None

    def squeue_steps(self) -> List[Tuple[str, str]]:
        """(step id, node list) of every running step."""
        code, out = self.exec(["squeue", "-h", "-s", "-o", "%i %N"])
        return [tuple(line.split()) for line in out.splitlines() if len(line.split()) == 2]


@pytest.fixture(scope="session")
def slurm_image(docker_client, distlib_image) -> str:
    import docker

    reuse = os.environ.get(SLURM_IMAGE_ENV, "").strip()
    if reuse:
        try:
            docker_client.images.get(reuse)
        except docker.errors.ImageNotFound:
            pytest.fail(f"{SLURM_IMAGE_ENV}={reuse}: no such image", pytrace=False)
        return reuse
    return build_slurm_image(distlib_image)


@contextlib.contextmanager
def slurm_cluster_of(client, image: str, nodes: int, key_dir: Path) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(client, image, nodes, key_dir)
    try:
        yield cluster.start()
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def slurm_cluster(docker_client, slurm_image, tmp_path_factory) -> Iterator[SlurmCluster]:
    """Two nodes (2 CPUs' worth each: `srun -O` runs more tasks than that), up and idle."""
    if not docker_client.info().get("ServerVersion"):
        unavailable("the Docker engine did not say its version", "slurm")
    with slurm_cluster_of(docker_client, slurm_image, 2, tmp_path_factory.mktemp("slurm-key")) as cluster:
        yield cluster
