"""The chart's NetworkPolicies (issue 28): on by default where the token is, they let only
the release's own pods (workers, master, helm test pod) reach the master's port and the
workers' ports. Checked on the rendered manifests (which pods each policy selects and admits,
by the labels the other templates give them), against the values schema, and against the
Kubernetes API schemas. The real-cluster lane (test_rendered_run.py, Kubernetes 1.20) has the
apiserver store them, but no network plugin there enforces them: enforcement is untested."""

from __future__ import annotations

from typing import Any

import pytest

from ._chart import SCENARIOS, WANTED_KUBE_VERSIONS, Rendered, render, scenario_values

RELEASE_PODS = {"app.kubernetes.io/name": "distlib", "app.kubernetes.io/instance": "train"}


def policies(r: Rendered) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in r.of_kind("NetworkPolicy")}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector with matchLabels only (the chart's) selects ``labels``."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pod_labels(r: Rendered) -> dict[str, dict[str, str]]:
    """The labels of each kind of pod the rendering makes: worker, master, test."""
    out = {"worker": r.job["spec"]["template"]["metadata"]["labels"]}
    master = r.maybe("Deployment", "master")
    if master is not None:
        out["master"] = master["spec"]["template"]["metadata"]["labels"]
    for pod in r.of_kind("Pod"):
        out["test"] = pod["metadata"]["labels"]
    return out


def admitted(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether some ingress rule of ``policy`` admits a pod of the same namespace with ``labels``."""
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            if "podSelector" in peer and "namespaceSelector" not in peer and selects(peer["podSelector"], labels):
                return True
    return False


def test_on_by_default_with_the_token_master_and_workers_fenced(chart: Any) -> None:
    r = render(chart, {})
    found = policies(r)
    assert sorted(found) == ["master", "worker"]
    labels = pod_labels(r)
    master, workers = found["master"], found["worker"]
    assert selects(master["spec"]["podSelector"], labels["master"])
    assert not selects(master["spec"]["podSelector"], labels["worker"])
    assert selects(workers["spec"]["podSelector"], labels["worker"])
    assert not selects(workers["spec"]["podSelector"], labels["master"])
    for policy in (master, workers):
        assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress is not restricted
        assert policy["metadata"]["namespace"] == "ml"
        for kind in ("worker", "master", "test"):  # the release's own pods, the helm test pod among them
            assert admitted(policy, labels[kind]), (policy["metadata"]["name"], kind)
        other_release = dict(labels["worker"], **{"app.kubernetes.io/instance": "someone-else"})
        assert not admitted(policy, other_release)
        assert not admitted(policy, {"app": "anything"})
    (rule,) = master["spec"]["ingress"]
    assert rule["ports"] == [{"port": 29500, "protocol": "TCP"}]  # the store's port only
    container_ports = r.one("Deployment", "master")["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert [p["containerPort"] for p in container_ports] == [29500]
    (rule,) = workers["spec"]["ingress"]
    assert "ports" not in rule  # every port: the mesh's and NCCL's are chosen at run time


@pytest.mark.parametrize("values, expected", [
    ({"auth": {"enabled": False}}, []),
    ({"auth": {"enabled": False}, "networkPolicy": {"enabled": True}}, ["master", "worker"]),
    ({"networkPolicy": {"enabled": False}}, []),
    ({"networkPolicy": {"enabled": None}}, ["master", "worker"]),
])
def test_enabled_follows_the_token_unless_set(chart: Any, values: dict[str, Any], expected: list[str]) -> None:
    assert sorted(policies(render(chart, values))) == expected


@pytest.mark.parametrize("scenario", ["rank0", "file-claim", "file-nfs", "tcp-external-master", "gpu"])
def test_modes_without_a_master_deployment_fence_the_workers(chart: Any, scenario: str) -> None:
    """rank0: pod 0's store is a worker's port (the workers' policy admits the release on every
    port); file: the mesh; an external master is not the chart's to fence."""
    r = render(chart, scenario_values(scenario))
    found = policies(r)
    assert sorted(found) == (["worker"] if r.maybe("Deployment", "master") is None else ["master", "worker"])
    labels = pod_labels(r)
    assert selects(found["worker"]["spec"]["podSelector"], labels["worker"])
    assert admitted(found["worker"], labels["worker"])


def test_extra_peers_are_admitted_too(chart: Any) -> None:
    extra = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
             {"ipBlock": {"cidr": "10.20.0.0/16"}}]
    r = render(chart, {"networkPolicy": {"extraFrom": extra}})
    for policy in policies(r).values():
        (rule,) = policy["spec"]["ingress"]
        assert rule["from"][1:] == extra
        assert rule["from"][0] == {"podSelector": {"matchLabels": RELEASE_PODS}}


@pytest.mark.parametrize("values, pointer", [
    ({"networkPolicy": {"enabled": "yes"}}, "/networkPolicy/enabled"),
    ({"networkPolicy": {"extraFrom": [{"pods": {}}]}}, "/networkPolicy/extraFrom/0"),
    ({"networkPolicy": {"extraFrom": [{}]}}, "/networkPolicy/extraFrom/0"),
    ({"networkPolicy": {"ports": [1]}}, "/networkPolicy"),
])
def test_the_schema_rejects_bad_values(helm: Any, chart: Any, values: dict[str, Any], pointer: str) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        chart.validate_schema(values)
    assert f"at '{pointer}'" in str(info.value), str(info.value)


def test_the_scenarios_and_the_defaults_pass_the_schema(chart: Any) -> None:
    chart.validate_schema({"networkPolicy": {"enabled": True, "extraFrom": [{"podSelector": {}}]}})
    for name in SCENARIOS:
        chart.validate_schema(scenario_values(name))


@pytest.mark.parametrize("kube_version", WANTED_KUBE_VERSIONS)
def test_the_policies_are_valid_kubernetes(chart: Any, kubernetes_validate: Any, kube_versions: list[str],
                                           kube_version: str) -> None:
    if kube_version not in kube_versions:
        pytest.skip(f"this kubernetes-validate has no schemas for {kube_version}")
    extra = [{"namespaceSelector": {"matchLabels": {"team": "ml"}}, "podSelector": {"matchLabels": {"app": "x"}}},
             {"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.1.0/24"]}}]
    for values in ({}, {"mode": "rank0"}, {"networkPolicy": {"extraFrom": extra}}):
        docs = render(chart, values).of_kind("NetworkPolicy")
        assert docs
        for doc in docs:
            kubernetes_validate.validate(doc, kube_version, strict=True)
