"""Fixtures of the Helm chart tests: the chart loaded once with Helm's engine, and the
Kubernetes versions the rendered manifests are validated against.

helm-python-sdk and kubernetes-validate come with the test extras (pip install -e '.[test]');
where they cannot be installed the tests that need them are skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

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
