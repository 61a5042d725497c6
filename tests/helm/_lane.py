"""What the real-cluster tests do with the chart: a namespace of their own, ``helm install``
with Helm's Go SDK (helm-python-sdk) into the cluster of the ``kube`` fixture, waiting for the
workers' Job, and reading what its pods said and wrote."""

from __future__ import annotations

import contextlib
import datetime
import io
import tarfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import kube as kube_cluster  # (`kube` is the fixture's name)
from ._chart import RELEASE

# The Job's deadline in the failure cases, and the longest any job of these tests may take.
JOB_TIMEOUT_S = 240


def parse_time(text: str) -> float:
    """An API timestamp ("2026-11-27T03:59:28Z") as seconds since the epoch."""
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()


def dns_query(server: str, name: str, qtype: int, timeout_s: float = 2.0) -> list[str]:
    """One UDP DNS question to ``server``:53 (qtype 1: A, 12: PTR): the answers' addresses or
    names; [] for none or NXDOMAIN."""
    import os
    import socket
    import struct

    qid = int.from_bytes(os.urandom(2), "big")
    query = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    query += b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\0" + struct.pack("!HH", qtype, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout_s)
        s.sendto(query, (server, 53))
        reply = s.recv(512)
    got_id, _flags, _qd, ancount = struct.unpack("!HHHH", reply[:8])
    assert got_id == qid
    at = 12 + len(query) - 12  # the question is echoed as asked
    out = []
    for _ in range(ancount):
        at += 2  # a pointer to the question's name
        rtype, _cls, _ttl, rdlen = struct.unpack("!HHIH", reply[at:at + 10])
        data = reply[at + 10:at + 10 + rdlen]
        at += 10 + rdlen
        if rtype == 1:
            out.append(socket.inet_ntoa(data))
        elif rtype == 12:
            labels, i = [], 0
            while data[i]:
                labels.append(data[i + 1:i + 1 + data[i]].decode())
                i += 1 + data[i]
            out.append(".".join(labels))
    return out


def image_values(image: str) -> dict[str, str]:
    repo, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        repo, tag = image, "latest"
    # Never: there is no registry; the kubelet must use the image the Docker engine has.
    return {"repository": repo, "tag": tag, "pullPolicy": "Never"}


#: the label on the PersistentVolumes this lane makes for a namespace (deleted with it)
PV_NAMESPACE_LABEL = "distlib.test/namespace"


@contextlib.contextmanager
def namespace(kube: Any) -> Iterator[str]:
    """A namespace of its own per test (part of every DNS name), deleted with its pods after,
    and with the PersistentVolumes the lane made for its claims."""
    ns = kube.cluster.namespace(f"{kube_cluster.NAMESPACE_PREFIX}{uuid.uuid4().hex[:8]}")
    try:
        yield ns
    finally:
        kube.cluster.delete_namespace(ns)
        for pv in kube.api.items("/api/v1/persistentvolumes", labelSelector=f"{PV_NAMESPACE_LABEL}={ns}"):
            kube.api.delete(f"/api/v1/persistentvolumes/{pv['metadata']['name']}")


def _wants_master_claim(values: dict[str, Any]) -> bool:
    """Whether the chart makes the master's state claim for these values (master.persistence)."""
    master = values.get("master", {})
    persistence = master.get("persistence", {})
    return (values.get("mode", "tcp") == "tcp" and not master.get("externalEndpoint")
            and persistence.get("enabled", True) and not persistence.get("existingClaim"))


def master_state_volume(kube: Any, ns: str, release: str = RELEASE) -> Path:
    """The lane's provisioner, for the master's state claim (the cluster has no dynamic
    provisioner): a hostPath PersistentVolume of class "" bound in advance to the chart's claim
    "<release>-distlib-master-state", in a directory of the cluster's work directory (one node:
    what a new master pod on it mounts is what the old one wrote). Deleted with the namespace.
    The directory is world-writable: hostPath gets no fsGroup, and the pods run as uid 1000."""
    claim = f"{release}-distlib-master-state"
    host_dir = Path(kube.cluster.workdir) / "volumes" / ns / claim
    host_dir.mkdir(parents=True, exist_ok=True)
    host_dir.chmod(0o1777)
    kube.api.create("/api/v1/persistentvolumes", {
        "metadata": {"name": f"{ns}-{claim}", "labels": {PV_NAMESPACE_LABEL: ns}},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "claimRef": {"namespace": ns, "name": claim},
                 "hostPath": {"path": str(host_dir), "type": "Directory"}}})
    return host_dir


def helm_config(helm: Any, kube: Any, ns: str) -> Any:
    return helm.Config(kubeconfig_path=str(kube.cluster.kubeconfig), namespace=ns)


def install(helm: Any, kube: Any, chart: Any, ns: str, values: dict[str, Any],
            release: str = RELEASE) -> dict[str, Any]:
    """``helm install <release> <chart> -n <ns> --values ...``: the release's summary (with the
    rendered ``manifest``). The master's state claim, when the values make one, is bound to a
    hostPath volume made here first (master_state_volume)."""
    import json

    from helm_python import _native

    # `helm install --disable-openapi-validation --server-side=false`: Helm 4 checks the
    # manifests against the server's OpenAPI and applies them server-side, and 1.20's schema has
    # no Job.spec.completionMode (the stand-in's field), which both refuse; a plain create (Helm
    # 3's way) is stored with the field dropped, as 1.20 drops it for any client.
    # helm-python-sdk's install() has no arguments for these options of Helm's, so its call is
    # made here as install() makes it, with them added.
    if _wants_master_claim(values):
        master_state_volume(kube, ns, release)
    options = {"namespace": ns, "timeout_seconds": 60, "disable_openapi_validation": True,
               "server_side_apply": False}
    with helm_config(helm, kube, ns) as cfg:
        handle, ref = cfg._chart_args(chart)
        payload = _native.call_string("helm_install", cfg._raw(), cfg._context_arg(None), handle, ref, release,
                                      json.dumps(values), json.dumps(options))
    return dict(json.loads(payload))


def pods(kube: Any, ns: str, component: str | None = None) -> list[dict[str, Any]]:
    sel = {"labelSelector": f"app.kubernetes.io/component={component}"} if component else {}
    return kube.api.items(f"/api/v1/namespaces/{ns}/pods", **sel)


def describe(kube: Any, ns: str) -> str:
    """One line per pod: phase, node, IP, each container's state (for failure messages)."""
    lines = []
    for p in pods(kube, ns):
        st = p.get("status", {})
        states = []
        for c in st.get("initContainerStatuses", []) + st.get("containerStatuses", []):
            (kind, detail), = c.get("state", {"?": {}}).items()
            states.append(f"{c['name']}={kind}{'(' + str(detail.get('exitCode')) + ')' if 'exitCode' in detail else ''}"
                          f"{' ' + detail.get('reason', '') if detail.get('reason') else ''} restarts={c.get('restartCount')}")
        lines.append(f"  {p['metadata']['name']}: {st.get('phase')} ip={st.get('podIP')} {'; '.join(states)}"
                     f"{' ' + str(st.get('reason')) if st.get('reason') else ''}")
    return "\n".join(lines) or "  (no pods)"


def job_condition(job: dict[str, Any]) -> str | None:
    for c in job.get("status", {}).get("conditions", []):
        if c["type"] in ("Complete", "Failed") and c["status"] == "True":
            return c["type"] if c["type"] == "Complete" else f"Failed: {c.get('reason')}"
    return None


@dataclass
class JobResult:
    job: dict[str, Any]
    condition: str
    seconds: float
    pods: dict[int, dict[str, Any]]  # completion index -> its last pod
    every: list[dict[str, Any]] = field(default_factory=list)  # every pod of the Job, oldest first

    @property
    def uid(self) -> str:
        return str(self.job["metadata"]["uid"])

    def history(self, kube: Any, container: str, lines: int = 40) -> str:
        """Every pod of the Job, oldest first, with its phase and the last ``lines`` lines of
        ``container``'s log: where a Job that restarted or failed first went wrong."""
        out = []
        for p in self.every:
            try:
                text = logs(kube, p, container)
            except Exception as exc:  # noqa: BLE001 - a pod whose log is gone is reported, not fatal
                text = f"(no log: {exc})"
            tail = "\n".join(text.splitlines()[-lines:])
            out.append(f"--- pod {p['metadata']['name']} ({p['status'].get('phase')}), the last {lines} lines "
                       f"of {container}:\n{tail}")
        return "\n".join(out)


def wait_job(kube: Any, ns: str, name: str, timeout_s: float = JOB_TIMEOUT_S) -> JobResult:
    """Wait for the Job's Complete or Failed condition; the error lists every pod's state."""
    started = time.monotonic()
    path = f"/apis/batch/v1/namespaces/{ns}/jobs/{name}"
    while True:
        kube.check()
        job = kube.api.get(path)
        cond = job_condition(job)
        if cond:
            break
        if time.monotonic() - started > timeout_s:
            raise kube_cluster.KubeError(f"Job {ns}/{name} neither Complete nor Failed after {timeout_s:.0f} s; "
                                  f"status {job.get('status')}; pods:\n{describe(kube, ns)}")
        time.sleep(0.5)
    by_index: dict[int, dict[str, Any]] = {}
    every = sorted(kube.api.items(f"/api/v1/namespaces/{ns}/pods", labelSelector=f"controller-uid={job['metadata']['uid']}"),
                   key=lambda p: p["metadata"]["creationTimestamp"])
    for p in every:
        i = int(p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"])
        by_index[i] = p  # (the last one created)
    return JobResult(job, cond, time.monotonic() - started, by_index, every)


def logs(kube: Any, pod: dict[str, Any], container: str) -> str:
    meta = pod["metadata"]
    return kube.api.logs(meta["namespace"], meta["name"], container)


def read_file(docker_client: Any, pod: dict[str, Any], container: str, path: str) -> bytes | None:
    """A file in the (exited) container the kubelet ran for ``container`` of ``pod``; None when
    it is not there."""
    import docker

    meta = pod["metadata"]
    found = docker_client.containers.list(all=True, filters={"label": [
        f"io.kubernetes.pod.namespace={meta['namespace']}", f"io.kubernetes.pod.name={meta['name']}",
        f"io.kubernetes.container.name={container}"]})
    for ctr in found:
        try:
            stream, _ = ctr.get_archive(path)
        except docker.errors.NotFound:
            continue
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            f = tar.extractfile(member) if member else None
            if f is not None:
                return f.read()
    return None


def docker_container(docker_client: Any, pod: dict[str, Any], container: str) -> Any:
    """The running Docker container of ``container`` in ``pod`` (what `kubectl exec` enters)."""
    meta = pod["metadata"]
    found = docker_client.containers.list(filters={"label": [
        f"io.kubernetes.pod.namespace={meta['namespace']}", f"io.kubernetes.pod.name={meta['name']}",
        f"io.kubernetes.container.name={container}"]})
    assert len(found) == 1, f"{len(found)} running containers for {container} of pod {meta['name']}"
    return found[0]


@contextlib.contextmanager
def rwx_claim(kube: Any, ns: str, claim: str, host_dir: Path) -> Iterator[Path]:
    """A ReadWriteMany PersistentVolumeClaim bound to a hostPath PersistentVolume: one node, so
    every pod shares the directory (same-host sharing, not a network file system)."""
    host_dir.mkdir(parents=True, exist_ok=True)
    host_dir.chmod(0o1777)  # the chart's pods run as uid 1000; hostPath gets no fsGroup
    pv = f"{ns}-{claim}"
    kube.api.create("/api/v1/persistentvolumes", {
        "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(host_dir), "type": "Directory"}}})
    try:
        kube.api.create(f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
            "metadata": {"name": claim},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
                     "resources": {"requests": {"storage": "1Gi"}}}})
        kube.api.wait(f"claim {ns}/{claim} Bound", lambda: kube.api.get(
            f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{claim}")["status"].get("phase") == "Bound", 30)
        yield host_dir
    finally:
        kube.api.delete(f"/api/v1/persistentvolumes/{pv}")
