"""Rendering helpers for the Helm chart tests (no helm binary, no cluster).

The chart is rendered with Helm's own engine through the ``helm-python-sdk`` wheel
(``helm_python``); the rendered documents are parsed with PyYAML and looked at as plain dicts.
``expand_container`` plays the kubelet's part: it expands ``$(VAR)`` references in a container's
env and args the way Kubernetes does, so the tests can check what each worker really runs.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "distlib"
GPU_VALUES_FILE = CHART_DIR / "values-gpu.yaml"

RELEASE = "train"
NAMESPACE = "ml"
REVISION = 3

# The Kubernetes versions every rendered manifest is validated against (kubernetes-validate
# ships schemas for 1.25 and later; its 1.24 schemas fail with an internal error).
WANTED_KUBE_VERSIONS = ("1.29.0", "1.33.0", "1.37.0")

STANDARD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
)


def gpu_values() -> dict[str, Any]:
    with open(GPU_VALUES_FILE, encoding="utf-8") as f:
        return yaml.safe_load(f)


# Values of each rendering the tests look at: every rendezvous mode, both kinds of file storage,
# an external master service, and the GPU example file.
SCENARIOS: dict[str, dict[str, Any]] = {
    "tcp": {},
    # a shared store server has its own token: the chart mounts it from an existing Secret
    "tcp-external-master": {"master": {"externalEndpoint": "store.infra.svc.cluster.local:29400"},
                            "auth": {"existingSecret": "infra-store-token", "existingSecretKey": "store"}},
    "rank0": {"mode": "rank0", "nodes": 4, "nprocPerNode": 2},
    "file-claim": {"mode": "file", "file": {"existingClaim": "shared-rwx"}},
    "file-nfs": {
        "mode": "file",
        "file": {
            "nfs": {"server": "nfs.storage.example", "path": "/exports/distlib"},
            "subPath": "runs",
        },
    },
    "gpu": gpu_values(),
}


def scenario_values(name: str) -> dict[str, Any]:
    return copy.deepcopy(SCENARIOS[name])


@dataclass
class Rendered:
    """The documents one rendering produced, and its NOTES.txt."""

    values: dict[str, Any]
    docs: list[dict[str, Any]]
    notes: str
    namespace: str
    release: str
    revision: int
    files: dict[str, str] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, component: str | None = None) -> dict[str, Any]:
        found = [
            d
            for d in self.of_kind(kind)
            if component is None
            or d["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]
        assert len(found) == 1, f"expected one {kind} ({component}), got {[kn(d) for d in found]}"
        return found[0]

    def maybe(self, kind: str, component: str) -> dict[str, Any] | None:
        found = [
            d
            for d in self.of_kind(kind)
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]
        assert len(found) <= 1
        return found[0] if found else None

    @property
    def job(self) -> dict[str, Any]:
        return self.one("Job", "worker")

    @property
    def headless(self) -> dict[str, Any]:
        return self.one("Service", "worker")

    @property
    def worker_pod(self) -> dict[str, Any]:
        return self.job["spec"]["template"]["spec"]

    @property
    def worker(self) -> dict[str, Any]:
        (container,) = [c for c in self.worker_pod["containers"] if c["name"] == "worker"]
        return container

    def pod_specs(self) -> list[dict[str, Any]]:
        """Every pod spec: the Job's and the Deployment's templates, and the helm test Pod."""
        specs = []
        for d in self.docs:
            if d["kind"] in ("Job", "Deployment"):
                specs.append(d["spec"]["template"]["spec"])
            elif d["kind"] == "Pod":
                specs.append(d["spec"])
        return specs

    def dns(self, *parts: str) -> str:
        """A name under this rendering's namespace: "<parts>.<ns>.svc.cluster.local"."""
        return ".".join(parts + (self.namespace, "svc", "cluster.local"))


def kn(doc: dict[str, Any]) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def render(
    chart: Any,
    values: dict[str, Any] | None = None,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    revision: int = REVISION,
) -> Rendered:
    """Render the chart with Helm's engine; the values are checked against the schema first
    (as ``helm install`` does)."""
    values = values or {}
    files = chart.render(values, name=release, namespace=namespace, revision=revision)
    docs: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append(doc)
    return Rendered(values, docs, notes, namespace, release, revision, files)


def flags(args: list[str]) -> dict[str, str]:
    """The launcher's "--flag value" pairs before "-m" (distlib-run takes no bare switches here)."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i] != "-m":
        assert args[i].startswith("--"), f"unexpected argument {args[i]!r} in {args}"
        assert args[i] not in out, f"{args[i]} given twice"
        out[args[i]] = args[i + 1]
        i += 2
    return out


def program(args: list[str]) -> list[str]:
    """What follows "-m": the module and its arguments."""
    return args[args.index("-m") + 1 :]


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_ref(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, "$$" is an escaped "$",
    undefined references stay as written."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _REF.sub(sub, text)


def expand_container(
    container: dict[str, Any], pod_fields: dict[str, str], injected: dict[str, str]
) -> tuple[dict[str, str], list[str]]:
    """The environment and the argv the kubelet gives a container.

    ``pod_fields`` answers fieldRef paths (e.g. "metadata.labels['batch.kubernetes.io/controller-uid']");
    ``injected`` are the variables the Job controller appends to every container of an Indexed
    Job (JOB_COMPLETION_INDEX). Each env value may use only the variables defined before it.
    """
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "valueFrom" in var:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in pod_fields, f"no pod field {path!r} for {var['name']}"
            env[var["name"]] = pod_fields[path]
        else:
            env[var["name"]] = expand_ref(var.get("value", ""), env)
    for name, value in injected.items():
        env.setdefault(name, value)  # the controller adds a variable only where it is absent
    argv = [expand_ref(a, env) for a in container.get("command", []) + container.get("args", [])]
    return env, argv


def job_pod(rendered: Rendered, index: int, job_uid: str) -> dict[str, Any]:
    """What the Indexed Job controller makes of the pod template for one completion index:
    hostname, labels and the fields the downward API reads."""
    job = rendered.job
    tmpl = job["spec"]["template"]
    labels = dict(tmpl["metadata"]["labels"])
    labels.update(
        {
            "batch.kubernetes.io/controller-uid": job_uid,
            "controller-uid": job_uid,
            "batch.kubernetes.io/job-name": job["metadata"]["name"],
            "job-name": job["metadata"]["name"],
            "batch.kubernetes.io/job-completion-index": str(index),
        }
    )
    annotations = dict(tmpl["metadata"].get("annotations", {}))
    annotations["batch.kubernetes.io/job-completion-index"] = str(index)
    fields = {f"metadata.labels['{k}']": v for k, v in labels.items()}
    fields.update({f"metadata.annotations['{k}']": v for k, v in annotations.items()})
    fields["metadata.namespace"] = rendered.namespace
    return {
        "hostname": f"{job['metadata']['name']}-{index}",
        "labels": labels,
        "fields": fields,
        "injected": {"JOB_COMPLETION_INDEX": str(index)},
    }


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
