"""The two stand-ins the real-cluster lane needs, and nothing else (tests/support/kube.py runs
everything else for real: apiserver, scheduler, kubelet, the other controllers):

``IndexedJobs`` — the Indexed Job controller. Kubernetes 1.20 has none (``completionMode:
Indexed`` is 1.21+, and the 1.20 apiserver drops the field), so the control plane runs with
its Job controller off (``--controllers=*,-job``) and this one drives every Job the way the
1.21+ controller drives an Indexed one: one pod per completion index with the annotation and
label ``batch.kubernetes.io/job-completion-index``, ``JOB_COMPLETION_INDEX`` in every container
that lacks it, hostname ``<job>-<index>`` (the template's subdomain kept), the labels
``batch.kubernetes.io/controller-uid`` and ``batch.kubernetes.io/job-name`` (1.27+), owner
reference to the Job; a failed or deleted pod counts against ``backoffLimit`` and its index gets
a new pod; ``activeDeadlineSeconds``; the Job's status and Complete/Failed conditions.

``ClusterDNS`` — cluster DNS for the Services' names (there is no CoreDNS here): a UDP resolver
on the Docker bridge's address (the kubelet's ``--cluster-dns``), fed from the API's Services
and Endpoints as CoreDNS's kubernetes plugin is: ``<svc>.<ns>.svc.<domain>``,
``<hostname>.<svc>.<ns>.svc.<domain>`` for a headless Service's addresses with a hostname, and
their PTR records. With no kube-proxy a ClusterIP leads nowhere, so a ClusterIP Service's name
answers with its ready endpoints' addresses (what kube-proxy would forward to); a Service with
no ready endpoint is NXDOMAIN. Every other name is NXDOMAIN: nothing leaves the machine.
"""

from __future__ import annotations

import copy
import datetime
import socket
import struct
import threading
import time
from typing import Any

from tests.support.kube import Api, ApiError

INDEX_KEY = "batch.kubernetes.io/job-completion-index"
INDEX_ENV = {"name": "JOB_COMPLETION_INDEX",
             "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_KEY}']"}}}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()


class _Loop:
    """A daemon thread calling ``tick()`` every ``period_s`` until closed; errors are kept
    (``errors``), never raised in the thread."""

    def __init__(self, name: str, period_s: float):
        self.errors: list[str] = []
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def tick(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - kept for the tests to report
                if len(self.errors) < 100:
                    self.errors.append(f"{type(e).__name__}: {e}")
            self._stop.wait(self._period)

    def start(self) -> _Loop:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


class IndexedJobs(_Loop):
    """The Indexed Job controller of Kubernetes 1.21+ (see the module's docstring)."""

    def __init__(self, api: Api, period_s: float = 0.25):
        super().__init__("indexed-jobs", period_s)
        self.api = api
        self._failed: dict[str, set[str]] = {}  # Job uid -> uids of its pods that failed or vanished
        self._live: dict[str, dict[str, str]] = {}  # Job uid -> {pod uid: phase} at the last tick

    def tick(self) -> None:
        for job in self.api.items("/apis/batch/v1/jobs"):
            self.sync(job)

    def _pod(self, job: dict[str, Any], index: int) -> dict[str, Any]:
        meta, spec = job["metadata"], job["spec"]
        tmpl = copy.deepcopy(spec["template"])
        labels = dict(tmpl.get("metadata", {}).get("labels") or {})
        labels.update({"batch.kubernetes.io/controller-uid": meta["uid"], "controller-uid": meta["uid"],
                       "batch.kubernetes.io/job-name": meta["name"], "job-name": meta["name"],
                       INDEX_KEY: str(index)})
        annotations = dict(tmpl.get("metadata", {}).get("annotations") or {})
        annotations[INDEX_KEY] = str(index)
        pod_spec = tmpl["spec"]
        pod_spec["hostname"] = f"{meta['name']}-{index}"
        for c in pod_spec.get("initContainers", []) + pod_spec["containers"]:
            if not any(e["name"] == "JOB_COMPLETION_INDEX" for e in c.get("env", [])):
                c.setdefault("env", []).append(copy.deepcopy(INDEX_ENV))
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"generateName": f"{meta['name']}-{index}-", "namespace": meta["namespace"],
                             "labels": labels, "annotations": annotations,
                             "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                                  "uid": meta["uid"], "controller": True,
                                                  "blockOwnerDeletion": True}]},
                "spec": pod_spec}

    def sync(self, job: dict[str, Any]) -> None:
        meta, spec = job["metadata"], job["spec"]
        status = job.setdefault("status", {})
        if any(c["type"] in ("Complete", "Failed") and c["status"] == "True" for c in status.get("conditions", [])):
            return
        ns, uid = meta["namespace"], meta["uid"]
        pods = [p for p in self.api.items(f"/api/v1/namespaces/{ns}/pods", labelSelector=f"controller-uid={uid}")
                if any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences", []))]
        failed = self._failed.setdefault(uid, set())
        now_live = {p["metadata"]["uid"]: p["status"].get("phase", "Pending") for p in pods}
        for pod_uid, phase in self._live.get(uid, {}).items():
            if pod_uid not in now_live and phase != "Succeeded":
                failed.add(pod_uid)  # deleted before it succeeded: a failure (as 1.26+ counts it)
        self._live[uid] = now_live
        succeeded: set[int] = set()
        active: dict[int, dict[str, Any]] = {}
        for p in pods:
            index = int(p["metadata"]["annotations"][INDEX_KEY])
            phase = p["status"].get("phase")
            if phase == "Succeeded":
                succeeded.add(index)
            elif phase == "Failed":
                failed.add(p["metadata"]["uid"])
            elif not p["metadata"].get("deletionTimestamp"):
                active[index] = p
        completions = int(spec.get("completions") or 1)
        start = status.setdefault("startTime", _now())
        deadline = spec.get("activeDeadlineSeconds")
        reason = message = None
        if len(failed) > int(spec.get("backoffLimit", 6)):
            reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        elif deadline is not None and time.time() - _parse_time(start) > int(deadline):
            reason, message = "DeadlineExceeded", "Job was active longer than specified deadline"
        if reason:
            for p in active.values():
                self.api.delete(f"/api/v1/namespaces/{ns}/pods/{p['metadata']['name']}")
            active = {}
            status["conditions"] = [{"type": "Failed", "status": "True", "reason": reason, "message": message,
                                     "lastProbeTime": _now(), "lastTransitionTime": _now()}]
        elif len(succeeded) >= completions:
            status["conditions"] = [{"type": "Complete", "status": "True",
                                     "lastProbeTime": _now(), "lastTransitionTime": _now()}]
            status["completionTime"] = _now()
        else:
            for index in range(completions):
                if index not in succeeded and index not in active:
                    try:
                        active[index] = self.api.create(f"/api/v1/namespaces/{ns}/pods", self._pod(job, index))
                    except ApiError as e:
                        if e.status == 403 and "NamespaceTerminating" in str(e):
                            return  # the namespace goes, and the Job with it (the real controller's case too)
                        raise
        status.update(active=len(active), succeeded=len(succeeded), failed=len(failed),
                      completedIndexes=",".join(str(i) for i in sorted(succeeded)))
        try:
            self.api.request("PUT", f"/apis/batch/v1/namespaces/{ns}/jobs/{meta['name']}/status", job)
        except ApiError as e:
            if e.status not in (404, 409):  # gone, or changed since read: the next tick redoes it
                raise


def _encode_name(name: str) -> bytes:
    out = b""
    for label in name.rstrip(".").split("."):
        out += bytes([len(label)]) + label.encode()
    return out + b"\0"


def _ptr_name(ip: str) -> str:
    return ".".join(reversed(ip.split("."))) + ".in-addr.arpa"


class ClusterDNS(_Loop):
    """Cluster DNS for the Services' names (see the module's docstring); ``refresh()`` reads the
    API every ``period_s``, a UDP thread answers from the last snapshot."""

    def __init__(self, api: Api, bind_ip: str, domain: str = "cluster.local", port: int = 53,
                 period_s: float = 0.2):
        super().__init__("cluster-dns-feed", period_s)
        self.api = api
        self.domain = domain.strip(".")
        self.addresses: dict[str, list[str]] = {}
        self.pointers: dict[str, str] = {}
        self.queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((bind_ip, port))
        self._sock.settimeout(0.5)
        self._server = threading.Thread(target=self._serve, name="cluster-dns", daemon=True)

    def tick(self) -> None:
        addresses: dict[str, list[str]] = {}
        pointers: dict[str, str] = {}
        endpoints = {(e["metadata"]["namespace"], e["metadata"]["name"]): e
                     for e in self.api.items("/api/v1/endpoints")}
        for svc in self.api.items("/api/v1/services"):
            ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
            headless = svc["spec"].get("clusterIP") == "None"
            fqdn = f"{name}.{ns}.svc.{self.domain}"
            ips: list[str] = []
            for subset in (endpoints.get((ns, name)) or {}).get("subsets") or []:
                for a in subset.get("addresses") or []:
                    ips.append(a["ip"])
                    if headless and a.get("hostname"):
                        host = f"{a['hostname']}.{fqdn}"
                        addresses.setdefault(host, []).append(a["ip"])
                        pointers[_ptr_name(a["ip"])] = host
            if ips:
                addresses[fqdn] = sorted(set(ips))
        self.addresses, self.pointers = addresses, pointers

    def answer(self, query: bytes) -> bytes | None:
        if len(query) < 12:
            return None
        qid, flags, qdcount = struct.unpack("!HHH", query[:6])
        if qdcount != 1:
            return struct.pack("!HHHHHH", qid, 0x8000 | 0x0100 | 4, 0, 0, 0, 0)  # NOTIMP
        labels, at = [], 12
        while at < len(query) and query[at]:
            n = query[at]
            labels.append(query[at + 1 : at + 1 + n].decode("ascii", "replace").lower())
            at += 1 + n
        qtype, _qclass = struct.unpack("!HH", query[at + 1 : at + 5])
        question = query[12 : at + 5]
        name = ".".join(labels)
        records: list[bytes] = []
        found = name in self.addresses or name in self.pointers
        if qtype == 1 and name in self.addresses:
            for ip in self.addresses[name]:
                records.append(struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(ip))
        elif qtype == 12 and name in self.pointers:
            target = _encode_name(self.pointers[name])
            records.append(struct.pack("!HHHIH", 0xC00C, 12, 1, 5, len(target)) + target)
        rcode = 0 if found else 3  # NXDOMAIN: the name is not the cluster's, or has no address now
        head = struct.pack("!HHHHHH", qid, 0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | rcode,
                           1, len(records), 0, 0)
        return head + question + b"".join(records)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, peer = self._sock.recvfrom(512)
            except (socket.timeout, OSError):
                continue
            self.queries += 1
            try:
                reply = self.answer(query)
            except (struct.error, IndexError, UnicodeError):
                continue
            if reply:
                self._sock.sendto(reply, peer)

    def start(self) -> ClusterDNS:
        self.tick()
        super().start()
        self._server.start()
        return self

    def close(self) -> None:
        super().close()
        self._server.join(5)
        self._sock.close()
