"""The chart's elastic option (PyTorchJob's elasticPolicy in spirit): what the Job runs, what
distlib-run makes of it, and the values it refuses."""

from __future__ import annotations

from typing import Any

import pytest

from distlib.launcher.elastic_config import elastic_plan, is_elastic
from distlib.launcher.resolve import Flags, resolve
from distlib.run import build_parser

from ._chart import RELEASE, WANTED_KUBE_VERSIONS, expand_container, flags, job_pod, kn, render

ELASTIC = {"elastic": {"enabled": True, "minReplicas": 2, "maxRestarts": 4}, "nodes": 3}


def launched(r, index: int = 1):
    """(env, argv) of pod ``index`` as the kubelet starts it, and distlib-run's resolved view."""
    pod = job_pod(r, index, "0a1b2c3d")
    env, argv = expand_container(r.worker, pod["fields"], pod["injected"])
    assert argv[0] == "distlib-run"
    args = build_parser().parse_args(argv[1:])
    resolved = resolve(Flags(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, node_rank=args.node_rank,
                             rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint, run_id=args.run_id),
                       env)
    return env, args, resolved


def test_tcp_mode_runs_the_range_over_the_master_service(chart: Any) -> None:
    r = render(chart, ELASTIC)
    f = flags(r.worker["args"])
    assert (f["--nnodes"], f["--max-restarts"], f["--rdzv-backend"]) == ("2:3", "4", "c10d")
    assert f["--rdzv-endpoint"].startswith(f"{RELEASE}-distlib-master.")
    spec = r.job["spec"]
    assert spec["completions"] == spec["parallelism"] == 3
    assert spec["backoffLimit"] == 4, "a lost pod is replaced up to --max-restarts times"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    _env, args, resolved = launched(r)
    assert is_elastic(resolved, args.max_restarts)
    plan = elastic_plan(resolved, args.max_restarts, args.monitor_interval, args.rdzv_conf)
    assert (plan.min_nodes, plan.max_nodes, plan.max_restarts) == (2, 3, 4)
    assert resolved.node_rank.value == 1, "the completion index is the node's hint in round 0"


def test_file_mode_keeps_the_rounds_in_a_file_and_sets_no_init_method(chart: Any) -> None:
    values = {**ELASTIC, "mode": "file", "file": {"existingClaim": "shared-rwx"},
              "elastic": {"enabled": True, "maxReplicas": 4, "rdzvConf": "join_timeout=900"}}
    r = render(chart, values)
    assert r.job["spec"]["completions"] == 4
    env, args, resolved = launched(r, 0)
    assert "DISTLIB_INIT_METHOD" not in env
    assert resolved.rdzv_file.value == f"/shared/{env['DISTLIB_RUN_ID']}/rdzv"
    plan = elastic_plan(resolved, args.max_restarts, args.monitor_interval, args.rdzv_conf)
    assert (plan.min_nodes, plan.max_nodes, plan.max_restarts) == (1, 4, 3)
    assert plan.conf.join_timeout == 900


def test_without_elastic_the_job_is_unchanged(chart: Any) -> None:
    r = render(chart, {"nodes": 3})
    f = flags(r.worker["args"])
    assert f["--nnodes"] == "3" and "--max-restarts" not in f
    assert r.job["spec"]["backoffLimit"] == 0


@pytest.mark.parametrize("values, words", [
    ({"mode": "rank0"}, "elastic.enabled with mode \"rank0\": pod 0 hosts the store"),
    ({"elastic": {"enabled": True, "minReplicas": 5}}, "elastic.minReplicas (5) is larger than elastic.maxReplicas (3)"),
])
def test_the_templates_refuse_what_cannot_work(helm: Any, chart: Any, values: dict, words: str) -> None:
    merged = {**ELASTIC, **values}
    with pytest.raises(helm.HelmRenderError) as info:
        render(chart, merged)
    assert words in str(info.value)


def test_the_schema_refuses_a_malformed_rdzv_conf(helm: Any, chart: Any) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(chart, {"elastic": {"enabled": True, "rdzvConf": "join_timeout 900"}})


@pytest.mark.parametrize("kube_version", WANTED_KUBE_VERSIONS)
def test_the_elastic_job_is_valid_for_kubernetes(chart: Any, kubernetes_validate: Any, kube_versions: list,
                                                 kube_version: str) -> None:
    if kube_version not in kube_versions:
        pytest.skip(f"this kubernetes-validate has no schemas for {kube_version}")
    for doc in render(chart, ELASTIC).docs:
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{kn(doc)} is not valid for Kubernetes {kube_version}: {e.message} at {list(e.path)}")
