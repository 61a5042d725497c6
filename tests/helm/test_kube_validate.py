"""Every rendered manifest validated offline against the Kubernetes API schemas
(kubernetes-validate, strict: unknown fields are errors) for several Kubernetes versions."""

from __future__ import annotations

from typing import Any

import pytest

from ._chart import SCENARIOS, WANTED_KUBE_VERSIONS, kn, render, scenario_values

# Renderings beyond the scenarios: every optional field switched on, and the longest names.
EXTRA: dict[str, dict[str, Any]] = {
    "everything-set": {
        "mode": "file",
        "runId": "exp-7",
        "imagePullSecrets": [{"name": "regcred"}],
        "network": {"socketIfname": "eth0", "portRange": "30000-30100"},
        "file": {"existingClaim": "rwx", "subPath": "distlib/runs", "mountPath": "/shared"},
        "workers": {
            "activeDeadlineSeconds": 3600,
            "ttlSecondsAfterFinished": 0,
            "priorityClassName": "training",
            "podAnnotations": {"example.com/owner": "ml"},
            "podLabels": {"team": "ml"},
            "extraEnv": [
                {"name": "NCCL_DEBUG", "value": "INFO"},
                {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ],
        },
    },
    "long-names": {"mode": "rank0", "nodes": 1000},
}
RENDERINGS = {**{k: scenario_values(k) for k in SCENARIOS}, **EXTRA}


def test_at_least_two_kube_versions(kube_versions: list[str]) -> None:
    assert len(kube_versions) >= 2


@pytest.mark.parametrize("kube_version", WANTED_KUBE_VERSIONS)
@pytest.mark.parametrize("rendering", list(RENDERINGS))
def test_manifests_valid_for_kubernetes(
    chart: Any,
    kubernetes_validate: Any,
    kube_versions: list[str],
    rendering: str,
    kube_version: str,
) -> None:
    if kube_version not in kube_versions:
        pytest.skip(f"this kubernetes-validate has no schemas for {kube_version}")
    release = "a" * 53 if rendering == "long-names" else "train"
    r = render(chart, RENDERINGS[rendering], release=release)
    assert r.docs
    checked = []
    for doc in r.docs:
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(
                f"{kn(doc)} is not valid for Kubernetes {kube_version}: {e.message} at {list(e.path)}"
            )
        checked.append(kn(doc))
    assert any(c.startswith("Job/") for c in checked)
