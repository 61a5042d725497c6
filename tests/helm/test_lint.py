"""`make helm-lint` (pytest tests/helm -k lint): Helm's own linter in strict mode for every
rendezvous mode and the GPU values file, plus the static checks of the chart's files
(metadata, documented values, a schema that covers them with local $refs only)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ._chart import CHART_DIR, REPO, SCENARIOS, WANTED_KUBE_VERSIONS, scenario_values

SEVERITY = {0: "unknown", 1: "info", 2: "warning", 3: "error"}

# Lint findings at info level that are fine: the chart has no icon to point at.
ALLOWED_INFO = {"icon is recommended"}


def _findings(report: dict[str, Any]) -> list[str]:
    out = []
    for m in report["messages"]:
        if m["severity"] == 1 and m["error"] in ALLOWED_INFO:
            continue
        out.append(f"[{SEVERITY.get(m['severity'], m['severity'])}] {m['path']}: {m['error']}")
    return out


@pytest.mark.parametrize("kube_version", WANTED_KUBE_VERSIONS[:2])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_lint_strict(helm: Any, scenario: str, kube_version: str) -> None:
    report = helm.lint(
        str(CHART_DIR), scenario_values(scenario), strict=True, kube_version=f"v{kube_version}"
    )
    assert report["total_charts_linted"] == 1
    assert report["errors"] == [], report
    assert _findings(report) == []


def test_lint_reports_bad_values(helm: Any) -> None:
    """The linter is not blind: values the schema rejects are lint errors."""
    report = helm.lint(str(CHART_DIR), {"mode": "mpi"}, strict=True)
    assert any("/mode" in e and "'tcp', 'rank0', 'file'" in e for e in report["errors"]), report


def _pyproject_version() -> str:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    m = re.search(r'(?m)^version\s*=\s*"([^"]+)"', text)
    assert m, "no version in pyproject.toml"
    return m.group(1)


def _semver(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.match(r"v?(\d+)\.(\d+)\.(\d+)", v).groups())  # type: ignore[union-attr]


def test_lint_chart_metadata(chart: Any) -> None:
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text(encoding="utf-8"))
    assert meta["apiVersion"] == "v2"
    assert meta["name"] == "distlib" == chart.name
    assert meta["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", meta["version"])
    assert meta["appVersion"] == _pyproject_version(), "appVersion must follow pyproject.toml"
    # Helm's render and lint do not enforce kubeVersion: check the constraint by hand against
    # the versions the manifests are validated for.
    m = re.fullmatch(r">=\s*(\d+\.\d+\.\d+)(-0)?", meta["kubeVersion"])
    assert m, meta["kubeVersion"]
    for v in WANTED_KUBE_VERSIONS:
        assert _semver(v) >= _semver(m.group(1))


def _schema() -> dict[str, Any]:
    return json.loads((CHART_DIR / "values.schema.json").read_text(encoding="utf-8"))


def test_lint_schema_is_valid_and_local(chart: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = _schema()
    jsonschema.Draft7Validator.check_schema(schema)
    assert chart.schema == schema

    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref":
                    refs.append(v)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    assert refs, "expected $refs into #/definitions"
    assert all(r.startswith("#/") for r in refs), f"non-local $ref (Helm would fetch it): {refs}"
    # The defaults themselves are valid.
    jsonschema.Draft7Validator(schema).validate(
        yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    )


def _documented_keys(path: Path) -> dict[tuple[str, ...], bool]:
    """Every mapping key of a values file → whether a comment sits right above it or after it."""
    keys: dict[tuple[str, ...], bool] = {}
    stack: list[tuple[int, str]] = []
    comment_above = False
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped:
            comment_above = False
            continue
        if stripped.startswith("#"):
            comment_above = True
            continue
        m = re.match(r"^(\s*)([A-Za-z0-9_.\-/]+):(\s|$)", line)
        if m and not stripped.startswith("-"):
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, m.group(2)))
            keys[tuple(k for _, k in stack)] = comment_above or " # " in line
        comment_above = False
    return keys


def test_lint_every_value_documented_and_in_schema() -> None:
    """values.yaml documents every value next to it, and the schema knows every value
    (additionalProperties: false everywhere the chart defines the keys)."""
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text(encoding="utf-8"))
    documented = _documented_keys(CHART_DIR / "values.yaml")
    schema = _schema()
    missing_doc: list[str] = []
    missing_schema: list[str] = []

    def walk(node: dict[str, Any], sub: dict[str, Any], path: tuple[str, ...]) -> None:
        assert (
            sub.get("additionalProperties") is False
        ), f"{'.'.join(path) or 'top level'}: unknown keys allowed"
        for key, value in node.items():
            here = path + (key,)
            prop = sub.get("properties", {}).get(key)
            if prop is None:
                missing_schema.append(".".join(here))
                continue
            # A group of the chart's own values (an inline object with properties): document its
            # members. Anything else (a leaf, a Kubernetes object passed through) is one value.
            if isinstance(value, dict) and "properties" in prop:
                walk(value, prop, here)
            elif not documented.get(here):
                missing_doc.append(".".join(here))

    walk(values, schema, ())
    assert not missing_schema, f"values without a schema entry: {missing_schema}"
    assert not missing_doc, f"values without a comment next to them: {missing_doc}"


def test_lint_gpu_values_file() -> None:
    """The GPU example asks for one process per GPU, with a backend that uses NCCL."""
    gpu = yaml.safe_load((CHART_DIR / "values-gpu.yaml").read_text(encoding="utf-8"))
    assert gpu["backend"] in ("nccl", "cpu:gloo,cuda:nccl")
    assert gpu["workers"]["resources"]["limits"]["nvidia.com/gpu"] == gpu["nprocPerNode"]
