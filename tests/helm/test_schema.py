"""values.schema.json rejects bad values before anything is rendered: one test per rule, each
checking that Helm's message names the value and what is wrong with it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ._chart import CHART_DIR, RELEASE, SCENARIOS, scenario_values


def _rejected(helm: Any, chart: Any, values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmValuesError) as info:
        chart.validate_schema(values)
    message = str(info.value)
    # The message starts with the chart's name, then one "- at '<json pointer>': ..." per problem.
    assert message.startswith("distlib:"), message
    return message


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_valid_values_accepted(chart: Any, scenario: str) -> None:
    chart.validate_schema(scenario_values(scenario))


def test_defaults_accepted(chart: Any) -> None:
    chart.validate_schema({})
    chart.validate_schema(None)


# (values, the text the message must contain)
RULES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "nodes-wrong-type": ({"nodes": "4"}, ["at '/nodes'", "got string, want integer"]),
    "nodes-fraction": ({"nodes": 2.5}, ["at '/nodes'", "got number, want integer"]),
    "nodes-below-one": ({"nodes": 0}, ["at '/nodes'", "minimum: got 0, want 1"]),
    "nproc-not-int": ({"nprocPerNode": "gpu"}, ["at '/nprocPerNode'", "got string, want integer"]),
    "nproc-below-one": ({"nprocPerNode": 0}, ["at '/nprocPerNode'", "minimum: got 0, want 1"]),
    "unknown-mode": (
        {"mode": "mpi"},
        ["at '/mode'", "value must be one of 'tcp', 'rank0', 'file'"],
    ),
    "unknown-backend": (
        {"backend": "nccl,gloo"},
        ["at '/backend'", "value must be one of 'gloo', 'nccl', 'cpu:gloo,cuda:nccl'"],
    ),
    "file-without-storage": (
        {"mode": "file"},
        [
            "at '/file/existingClaim': minLength",
            "at '/file/nfs/server': minLength",
            "at '/file/nfs/path': minLength",
        ],
    ),
    "file-claim-and-nfs": (
        {"mode": "file", "file": {"existingClaim": "rwx", "nfs": {"server": "nfs", "path": "/x"}}},
        ["at '/file/nfs/server': maxLength: got 3, want 0"],
    ),
    "file-nfs-without-path": (
        {"mode": "file", "file": {"nfs": {"server": "nfs"}}},
        ["at '/file/nfs/path': minLength: got 0, want 1"],
    ),
    "file-nfs-relative-path": (
        {"mode": "file", "file": {"nfs": {"server": "nfs", "path": "exports"}}},
        ["at '/file/nfs/path'", "does not match pattern"],
    ),
    "image-tag-wrong-type": ({"image": {"tag": 1}}, ["at '/image/tag'", "got number, want string"]),
    "image-pull-policy": (
        {"image": {"pullPolicy": "Sometimes"}},
        ["at '/image/pullPolicy'", "value must be one of 'Always', 'IfNotPresent', 'Never'"],
    ),
    "unknown-top-level-key": (
        {"worker": {"nodes": 2}},
        ["additional properties 'worker' not allowed"],
    ),
    "unknown-nested-key": (
        {"workers": {"gpus": 8}},
        ["at '/workers'", "additional properties 'gpus' not allowed"],
    ),
    "master-port-range": ({"masterPort": 70000}, ["at '/masterPort'", "maximum: got 70"]),
    "run-id-characters": ({"runId": "my run"}, ["at '/runId'", "does not match pattern"]),
    "job-args-not-strings": (
        {"job": {"args": ["--steps", 200]}},
        ["at '/job/args/1'", "got number, want string"],
    ),
    "job-module-name": (
        {"job": {"module": "train-dp"}},
        ["at '/job/module'", "does not match pattern"],
    ),
    "shm-size-not-quantity": (
        {"workers": {"shm": {"sizeLimit": "1GB"}}},
        ["at '/workers/shm/sizeLimit'", "'1GB' does not match pattern"],
    ),
    "gpu-limit-not-quantity": (
        {"workers": {"resources": {"limits": {"nvidia.com/gpu": "eight"}}}},
        ["at '/workers/resources/limits/nvidia.com~1gpu'", "does not match pattern"],
    ),
    "toleration-effect": (
        {
            "workers": {
                "tolerations": [
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedul"}
                ]
            }
        },
        [
            "at '/workers/tolerations/0/effect'",
            "value must be one of 'NoSchedule', 'PreferNoSchedule', 'NoExecute'",
        ],
    ),
    "node-selector-values-strings": (
        {"workers": {"nodeSelector": {"nvidia.com/gpu.present": True}}},
        ["at '/workers/nodeSelector/nvidia.com~1gpu.present'", "got boolean, want string"],
    ),
    "runtime-class-name": (
        {"workers": {"runtimeClassName": "NVIDIA"}},
        ["at '/workers/runtimeClassName'"],
    ),
    "backoff-limit-negative": (
        {"workers": {"backoffLimit": -1}},
        ["at '/workers/backoffLimit'", "minimum: got -1, want 0"],
    ),
    "ttl-wrong-type": (
        {"workers": {"ttlSecondsAfterFinished": "1h"}},
        ["at '/workers/ttlSecondsAfterFinished'", "got string, want null or integer"],
    ),
    "extra-env-not-envvar": (
        {"workers": {"extraEnv": [{"NCCL_DEBUG": "INFO"}]}},
        ["at '/workers/extraEnv/0'", "missing property 'name'"],
    ),
    "extra-env-value-not-string": (
        {"workers": {"extraEnv": [{"name": "NCCL_IB_DISABLE", "value": 1}]}},
        ["at '/workers/extraEnv/0/value'", "got number, want string"],
    ),
    "port-range-format": (
        {"network": {"portRange": "30000:30100"}},
        ["at '/network/portRange'", "does not match pattern"],
    ),
    "external-endpoint-format": (
        {"master": {"externalEndpoint": "store.infra"}},
        ["at '/master/externalEndpoint'", "does not match pattern"],
    ),
    "master-sync": (
        {"master": {"persistence": {"sync": "always"}}},
        ["at '/master/persistence/sync'", "value must be one of 'turn', 'none'"],
    ),
    "probe-timing-key": (
        {"master": {"readinessProbe": {"periodSecond": 5}}},
        ["at '/master/readinessProbe'", "additional properties 'periodSecond' not allowed"],
    ),
    "mount-path-absolute": (
        {"file": {"mountPath": "mnt"}},
        ["at '/file/mountPath'", "does not match pattern"],
    ),
    "name-override-dns": (
        {"fullnameOverride": "My_Job"},
        ["at '/fullnameOverride'", "does not match pattern"],
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_schema_rejects(helm: Any, chart: Any, rule: str) -> None:
    values, expected = RULES[rule]
    message = _rejected(helm, chart, values)
    for text in expected:
        assert text in message, f"{rule}: {text!r} not in {message!r}"


def test_render_refuses_invalid_values(helm: Any, chart: Any) -> None:
    """An install renders nothing from bad values: rendering runs the same schema first."""
    with pytest.raises(helm.HelmValuesError, match=r"at '/mode': value must be one of"):
        chart.render({"mode": "mpi"}, name=RELEASE, namespace="ml")


@pytest.fixture(scope="module")
def chart_without_schema(helm: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The chart as `helm install --skip-schema-validation` sees it."""
    copy = Path(tmp_path_factory.mktemp("chart")) / "distlib"
    shutil.copytree(CHART_DIR, copy)
    (copy / "values.schema.json").unlink()
    with helm.Chart.load(str(copy)) as loaded:
        yield loaded


@pytest.mark.parametrize(
    ("file_values", "message"),
    [
        (
            {},
            'mode "file" needs a ReadWriteMany volume: set file.existingClaim, or file.nfs.server and file.nfs.path',
        ),
        (
            {"existingClaim": "rwx", "nfs": {"server": "nfs", "path": "/x"}},
            "set file.existingClaim or file.nfs, not both",
        ),
        ({"nfs": {"server": "nfs"}}, "file.nfs needs both server and path"),
    ],
    ids=["no-storage", "claim-and-nfs", "nfs-without-path"],
)
def test_templates_refuse_file_mode_without_one_volume(
    helm: Any, chart_without_schema: Any, file_values: dict[str, Any], message: str
) -> None:
    """With schema validation skipped the templates still refuse, in a plain sentence."""
    with pytest.raises(helm.HelmRenderError) as info:
        chart_without_schema.render(
            {"mode": "file", "file": file_values}, name=RELEASE, namespace="ml"
        )
    assert message in str(info.value)
