"""Failures of the chart's job on the real cluster (the ``kube`` fixture): what Kubernetes does
(the Deployment's ReplicaSet, the Job's replacement pod, graceful deletion with SIGTERM) and
what the ranks say about it.

* a worker pod deleted mid-job (elastic, the chart's policy for lost pods): the other node
  names it (host, address, pid, the signal) at once, the Job makes a new pod for its index,
  which joins the next round, and the job completes;
* the master pod deleted mid-job: every worker names the master Service it lost and keeps
  training, the Deployment starts a new master pod that replays its journal from the claim
  (master.persistence; a hostPath volume here), and the job completes in the same round, each
  node's report saying the master was away and for how long;
* a token Secret that is not the master's: the workers are refused and say by whom, and the
  master names them.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from . import _lane
from ._chart import RELEASE

pytestmark = [pytest.mark.kube, pytest.mark.timeout(480)]

JOB = f"{RELEASE}-distlib-workers"
MASTER_ENDPOINT = "{release}-distlib-master.{ns}.svc.cluster.local:29500"


def _values(image: str, *, steps: int, step_seconds: float, **extra: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "image": _lane.image_values(image), "mode": "tcp", "nodes": 2, "nprocPerNode": 1,
        "job": {"args": ["--epochs", "2", "--steps", str(steps), "--step-seconds", str(step_seconds),
                         "--bench-sizes", "none", "--timeout", "60"]},
    }
    values.update(extra)
    return values


def _pod_of(kube: Any, ns: str, index: int) -> dict[str, Any] | None:
    for p in _lane.pods(kube, ns, "worker"):
        if (p["metadata"]["annotations"].get("batch.kubernetes.io/job-completion-index") == str(index)
                and not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") == "Running"):
            return p
    return None


def _wait_log(kube: Any, pod: dict[str, Any], pattern: str, timeout_s: float, container: str = "worker") -> str:
    def seen() -> str | None:
        kube.check()
        text = _lane.logs(kube, pod, container)
        return text if re.search(pattern, text) else None

    try:
        return str(kube.api.wait(f"{pattern!r} in the log of pod {pod['metadata']['name']}", seen, timeout_s))
    except AssertionError as e:
        raise AssertionError(f"{e}\nthe log ends:\n{_lane.logs(kube, pod, container)[-3000:]}") from None


def test_a_deleted_worker_pod_is_named_replaced_and_the_job_completes(helm: Any, kube_chart: Any, kube: Any,
                                                                       distlib_image: str) -> None:
    values = _values(distlib_image, steps=40, step_seconds=0.1,
                     elastic={"enabled": True, "minReplicas": 1, "maxRestarts": 3})
    with _lane.namespace(kube) as ns:
        _lane.install(helm, kube, kube_chart, ns, values)
        first = kube.api.wait("the pods of both indexes Running", lambda: _pod_of(kube, ns, 0) and _pod_of(kube, ns, 1), 90)
        pod0, victim = _pod_of(kube, ns, 0), first
        assert pod0 is not None and victim is not None
        _wait_log(kube, pod0, r"train_dp: epoch 1/2", 120)
        deleted_at = time.monotonic()
        kube.api.delete(f"/api/v1/namespaces/{ns}/pods/{victim['metadata']['name']}")
        # the deleted pod's agent got SIGTERM and left the job: the other node names it at once
        said = _wait_log(kube, pod0, rf"node left: {JOB}-1 \(\S+, pid \d+\) received SIGTERM", 30)
        named_s = time.monotonic() - deleted_at
        replacement = kube.api.wait("a new pod for completion index 1", lambda: (
            (p := _pod_of(kube, ns, 1)) and p["metadata"]["uid"] != victim["metadata"]["uid"] and p), 60)
        # cluster DNS names both running pods, forward and reverse, from the headless Service
        for p in (pod0, kube.api.wait("the new pod's IP", lambda: (q := _pod_of(kube, ns, 1)) and q["status"].get("podIP") and q, 60)):
            fqdn = f"{p['spec']['hostname']}.{JOB}.{ns}.svc.cluster.local"
            ip = p["status"]["podIP"]
            kube.api.wait(f"{fqdn} <-> {ip} in cluster DNS", lambda: _lane.dns_query(kube.cluster.dns_ip, fqdn, 1) == [ip]
                          and _lane.dns_query(kube.cluster.dns_ip, ".".join(reversed(ip.split("."))) + ".in-addr.arpa", 12)
                          == [fqdn], 60)  # the stand-in learns a new pod from Endpoints: seconds on 2 loaded cores
        result = _lane.wait_job(kube, ns, JOB)
        log0 = _lane.logs(kube, result.pods[0], "worker")
        print(f"\n[worker deleted] named after {named_s:.1f} s; replacement {replacement['metadata']['name']} "
              f"(hostname {replacement['spec']['hostname']}); job {result.condition}, "
              f"status {result.job['status']}")
    assert named_s < 15, said[-2000:]
    assert replacement["spec"]["hostname"] == f"{JOB}-1"
    assert result.condition == "Complete", f"{result.condition}:\n{log0[-4000:]}"
    assert result.job["status"]["failed"] == 1, result.job["status"]  # the deleted pod, within maxRestarts
    assert "RESULT: PASS" in log0, log0[-4000:]


def test_a_deleted_master_pod_comes_back_with_its_state_and_the_job_completes(
        helm: Any, kube_chart: Any, kube: Any, distlib_image: str) -> None:
    """The master pod deleted mid-job (elastic): every worker names the master Service it lost
    and keeps training; the Deployment's new pod replays the journal from the claim (the lane's
    hostPath volume) before its port opens, and the job completes in round 0, no restart
    counted; each node's report says the master was away and for how long."""
    values = _values(distlib_image, steps=200, step_seconds=0.1,
                     elastic={"enabled": True, "minReplicas": 1, "maxRestarts": 3})
    with _lane.namespace(kube) as ns:
        endpoint = MASTER_ENDPOINT.format(release=RELEASE, ns=ns)
        _lane.install(helm, kube, kube_chart, ns, values)
        kube.api.wait("the pods of both indexes Running", lambda: _pod_of(kube, ns, 0) and _pod_of(kube, ns, 1), 90)
        workers = [_pod_of(kube, ns, i) for i in (0, 1)]
        _wait_log(kube, workers[0], r"train_dp: epoch 1/2", 120)
        (master,) = _lane.pods(kube, ns, "master")
        deleted_at = time.monotonic()
        kube.api.delete(f"/api/v1/namespaces/{ns}/pods/{master['metadata']['name']}")
        lost = rf"the rendezvous store \(TCPStore server {re.escape(endpoint)}\) did not answer"
        said = [_wait_log(kube, w, lost, 40) for w in workers]
        named_s = time.monotonic() - deleted_at

        def new_master_ready() -> dict[str, Any] | None:
            for p in _lane.pods(kube, ns, "master"):
                if p["metadata"]["uid"] != master["metadata"]["uid"] and any(
                        c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", [])):
                    return p
            return None

        again = kube.api.wait("the Deployment's new master pod Ready", new_master_ready, 90)
        ready_s = time.monotonic() - deleted_at
        result = _lane.wait_job(kube, ns, JOB)
        finals = [_lane.logs(kube, result.pods[i], "worker") for i in (0, 1)]
        away = (rf"^distlib-run: the rendezvous store \(TCPStore server {re.escape(endpoint)}\) was away for "
                r"([\d.]+) s in round 0 \(from [\d-]+ [\d:]+ UTC\): the job went on in the same round, no restart "
                r"counted$")
        seconds = [float(m.group(1)) for text in finals for m in re.finditer(away, text, re.M)]
        print(f"\n[master deleted] both workers named {endpoint} within {named_s:.1f} s; new master pod "
              f"{again['metadata']['name']} Ready {ready_s:.1f} s after the deletion; job {result.condition} in "
              f"{result.seconds:.0f} s after that; the nodes' reports: away for {seconds} s")
        for text in said:
            print("  " + [line for line in text.splitlines() if re.search(lost, line)][-1])
        print(_lane.describe(kube, ns))
        # every worker pod's log, oldest first, and the new master's: where a run that restarted
        # went wrong first (read now: the namespace goes with the block)
        history = result.history(kube, "worker", 60) + "\n--- the new master:\n" + \
            "\n".join(_lane.logs(kube, again, "store-server").splitlines()[-40:])
    assert named_s < 40
    assert result.condition == "Complete", f"{result.condition}:\n{history}"
    assert result.job["status"].get("failed", 0) == 0, f"{result.job['status']}\n{history}"  # no pod lost, none replaced
    assert "RESULT: PASS" in finals[0], finals[0][-3000:]
    for index, text in enumerate(finals):
        assert "round 1" not in text and "node lost" not in text, f"node {index} restarted:\n{history}"
        # one absence, or two: the old pod's server closes the connections when its SIGTERM
        # comes, and the agents may reach it once more before it is gone and the new one is in
        gone = [float(m.group(1)) for m in re.finditer(away, text, re.M)]
        assert 1 <= len(gone) <= 2 and all(0 < g < 60 for g in gone), \
            f"node {index}'s report does not say how long the master was away ({gone}):\n{text[-3000:]}"



def test_a_wrong_token_secret_is_refused_and_named(helm: Any, kube_chart: Any, kube: Any, distlib_image: str) -> None:
    """A second release whose workers use the first release's master service (a shared store
    server, master.externalEndpoint) with a Secret that holds another token."""
    with _lane.namespace(kube) as ns:
        endpoint = MASTER_ENDPOINT.format(release=RELEASE, ns=ns)
        _lane.install(helm, kube, kube_chart, ns, _values(distlib_image, steps=4, step_seconds=0.0))
        kube.api.create(f"/api/v1/namespaces/{ns}/secrets", {
            "metadata": {"name": "not-the-masters-token"}, "type": "Opaque",
            "stringData": {"token": "this-is-not-the-token-of-the-master"}})
        other = "other"
        values = _values(distlib_image, steps=4, step_seconds=0.0,
                         master={"externalEndpoint": endpoint},
                         auth={"existingSecret": "not-the-masters-token", "existingSecretKey": "token"},
                         workers={"activeDeadlineSeconds": 60})
        _lane.install(helm, kube, kube_chart, ns, values, release=other)
        other_job = f"{other}-distlib-workers"
        refused = re.escape("authentication to") + r".*" + re.escape(endpoint.split(":")[0]) + r".*wrong token"
        workers = kube.api.wait("the other release's workers running", lambda: [
            p for p in _lane.pods(kube, ns, "worker")
            if p["metadata"]["labels"].get("job-name") == other_job and p["status"].get("podIP")], 90)
        said = _wait_log(kube, workers[0], refused, 60)
        (master,) = _lane.pods(kube, ns, "master")
        master_log = _wait_log(kube, master, r"refused: wrong token", 30, container="store-server")
        line = next(x for x in said.splitlines() if re.search(refused, x))
        print(f"\n[wrong token] worker: {line}\n[wrong token] master: "
              f"{next(x for x in master_log.splitlines() if 'refused: wrong token' in x)}")
        result = _lane.wait_job(kube, ns, other_job)
    assert result.condition.startswith("Failed"), result.job.get("status")
