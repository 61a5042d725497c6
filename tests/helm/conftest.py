"""Fixtures of the Helm chart tests: the chart loaded once with Helm's engine, the
Kubernetes versions the rendered manifests are validated against, and a real Kubernetes 1.20
cluster on this machine (``kube``: tests/support/kube.py, with the two stand-ins of
tests/support/kube_stand_ins.py) the chart is
installed into.

helm-python-sdk and kubernetes-validate come with the test extras (pip install -e '.[test]');
where they cannot be installed the tests that need them are skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support import kube_stand_ins
from tests.support import kube as kube_cluster  # (the fixture below is `kube`)
from tests.support.lanes import unavailable

from ._chart import CHART_DIR, WANTED_KUBE_VERSIONS


@pytest.fixture(scope="session")
def helm() -> Any:
    return pytest.importorskip(
        "helm_python", reason="helm-python-sdk (Helm's Go SDK as a wheel) is not installed"
    )


@pytest.fixture(scope="session")
def chart(helm: Any) -> Iterator[Any]:
    with helm.Chart.load(str(CHART_DIR)) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def kubernetes_validate() -> Any:
    return pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate (offline Kubernetes API schemas) is not installed",
    )


@pytest.fixture(scope="session")
def kube_versions(kubernetes_validate: Any) -> list[str]:
    """The wanted versions this kubernetes-validate has schemas for: at least two."""
    from kubernetes_validate import utils

    have = set(utils.all_versions())
    versions = [v for v in WANTED_KUBE_VERSIONS if v in have]
    assert len(versions) >= 2, (
        f"kubernetes-validate {kubernetes_validate.__version__} has schemas for {sorted(have)}; "
        f"the chart tests need at least two of {WANTED_KUBE_VERSIONS}: upgrade it"
    )
    return versions


@dataclass
class Kube:
    """The running cluster and its two stand-ins."""

    cluster: kube_cluster.Cluster
    jobs: kube_stand_ins.IndexedJobs
    dns: kube_stand_ins.ClusterDNS

    @property
    def api(self) -> kube_cluster.Api:
        return self.cluster.api

    def check(self) -> None:
        """The control plane still runs and the stand-ins have raised nothing."""
        self.cluster.check_alive()
        for loop in (self.jobs, self.dns):
            assert not loop.errors, f"{type(loop).__name__} failed: {loop.errors[:3]}"


@pytest.fixture(scope="session")
def kube(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    """Kubernetes 1.20 (etcd, apiserver, controller-manager, scheduler, kubelet) on 127.0.0.1,
    built once into settings.cache_dir() (tests/platforms/build-kube.sh, 7-11 min cold)."""
    if shutil.which("apt-get") is None or not os.path.exists("/proc/self/mountinfo"):
        unavailable("the real-cluster tests need a Debian Linux host (apt-get) to build Kubernetes", "kube")
    if os.geteuid() != 0:
        unavailable("the kubelet needs root (mounts, the Docker socket)", "kube")
    try:
        build = kube_cluster.build()
    except kube_cluster.KubeError as exc:
        pytest.fail(str(exc), pytrace=False)
    with kube_cluster.start(build, tmp_path_factory.mktemp("kube"), docker_client) as cluster:
        dns = kube_stand_ins.ClusterDNS(cluster.api, cluster.dns_ip).start()
        jobs = kube_stand_ins.IndexedJobs(cluster.api).start()
        try:
            yield Kube(cluster, jobs, dns)
        finally:
            jobs.close()
            dns.close()


@pytest.fixture(scope="session")
def kube_chart(helm: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The chart as the real-cluster lane installs it: a copy with Chart.yaml's kubeVersion
    (>=1.28, for the Job labels 1.27/1.28 add) lifted, since Helm refuses a 1.20 cluster; those
    labels are what the Indexed Job stand-in gives the pods. Nothing else differs."""
    copy = tmp_path_factory.mktemp("chart") / "distlib"
    shutil.copytree(CHART_DIR, copy)
    meta = copy / "Chart.yaml"
    lines = meta.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith("kubeVersion:")]
    assert len(kept) == len(lines) - 1, "Chart.yaml has no kubeVersion line to lift"
    meta.write_text("".join(kept))
    with helm.Chart.load(str(copy)) as loaded:
        yield loaded
