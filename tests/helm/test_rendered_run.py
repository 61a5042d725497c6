"""The chart installed with Helm into a real Kubernetes (1.20: its own apiserver, scheduler,
controllers and kubelet, the ``kube`` fixture) and its training job run to its report.

``helm install`` (Helm's Go SDK) creates the Secret, the Services, the master Deployment and
the workers' Job; the scheduler places the pods, the kubelet runs them as containers of this
Docker engine with the chart's env (downward API, ``$(VAR)`` expansion), Secret and emptyDir
mounts, securityContext, probes and restart policy, on real pod IPs. Only two things are stood
in for (tests/support/kube_stand_ins.py): the Indexed Job controller (1.21+) and cluster DNS. Then every
worker must succeed and global rank 0's report must show the whole world: every rank on the pod
hostname its completion index implies, at its pod's IP, identical weights, losses, the run id
made of the Job's uid. Modes tcp (the master's probes and the ``helm test`` pod presenting the
chart's token, a client without it refused), file (a ReadWriteMany claim: a hostPath volume on
the one node) and rank0; and a wrong master name, which must fail clearly.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from typing import Any

import pytest

from . import _lane
from ._chart import RELEASE, flags

pytestmark = [pytest.mark.kube, pytest.mark.timeout(480)]

CLAIM = "shared-rwx"
EPOCHS = 2
# Short training, no bandwidth measurement; a failing collective gives up after 60 s.
JOB_ARGS = ["--epochs", str(EPOCHS), "--steps", "8", "--bench-sizes", "none", "--timeout", "60"]
REPORTS = {
    "tcp": "/tmp/$(DISTLIB_RUN_ID)/report.json",
    "rank0": "/tmp/$(DISTLIB_RUN_ID)/report.json",
    "file": "/shared/$(DISTLIB_RUN_ID)/report.json",
}
# nodes x nprocPerNode: two processes per pod (local ranks) in tcp and rank0 modes, three pods
# in file mode.
SHAPES = {"tcp": (2, 2), "rank0": (2, 2), "file": (3, 1)}


def values_for(mode: str, image: str) -> dict[str, Any]:
    nodes, nproc = SHAPES[mode]
    values: dict[str, Any] = {
        "image": _lane.image_values(image),
        "mode": mode,
        "nodes": nodes,
        "nprocPerNode": nproc,
        "job": {"args": JOB_ARGS + ["--report-json", REPORTS[mode]]},
    }
    if mode == "file":
        values["file"] = {"existingClaim": CLAIM}
    return values


def _manifest_docs(release: dict[str, Any]) -> list[dict[str, Any]]:
    import yaml

    return [d for d in yaml.safe_load_all(release["manifest"]) if d]


@pytest.mark.parametrize("mode", ["tcp", "file", "rank0"])
def test_chart_runs_the_job_on_kubernetes(mode: str, helm: Any, kube_chart: Any, kube: Any, docker_client: Any,
                                          distlib_image: str, tmp_path: Any) -> None:
    nodes, nproc = SHAPES[mode]
    world = nodes * nproc
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        ns = stack.enter_context(_lane.namespace(kube))
        shared = stack.enter_context(_lane.rwx_claim(kube, ns, CLAIM, tmp_path / "rwx")) if mode == "file" else None
        release = _lane.install(helm, kube, kube_chart, ns, values_for(mode, distlib_image))
        docs = _manifest_docs(release)
        (job_doc,) = [d for d in docs if d["kind"] == "Job"]
        # what Helm sent; the 1.20 apiserver drops completionMode, the stand-in honours it
        assert job_doc["spec"]["completionMode"] == "Indexed"
        job_name = job_doc["metadata"]["name"]
        ready_s = None
        if mode == "tcp":
            ready_s = _wait_master_ready(kube, ns)
        result = _lane.wait_job(kube, ns, job_name)
        assert result.condition == "Complete", (
            f"Job {job_name}: {result.condition}; pods:\n{_lane.describe(kube, ns)}\n"
            + "\n".join(f"--- pod {i}:\n{_lane.logs(kube, p, 'worker')[-3000:]}" for i, p in result.pods.items()))
        # the NetworkPolicies Helm sent are stored (nothing enforces them here: no network plugin)
        policies = [d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"]
        stored = kube.api.items(f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies")
        assert sorted(policies) == sorted(p["metadata"]["name"] for p in stored) and policies, (policies, stored)
        if mode == "tcp":
            _check_master(kube, ns, docker_client)
            with _lane.helm_config(helm, kube, ns) as cfg:
                tested = cfg.test(RELEASE, timeout=60, logs=True)  # raises unless the ping exits 0
            ping_log = str(tested.get("logs", "")).strip()
            print(f"\n[tcp] helm test: {ping_log}")
        run_id = f"{RELEASE}-{release.get('revision', release.get('version'))}-{result.uid}"
        rank0_log = _lane.logs(kube, result.pods[0], "worker")
        path = REPORTS[mode].replace("$(DISTLIB_RUN_ID)", run_id)
        if shared is not None:
            report_file = shared / run_id / "report.json"
            report_json = report_file.read_bytes() if report_file.exists() else None
        else:
            report_json = _lane.read_file(docker_client, result.pods[0], "worker", path)
        pod_ips = {i: p["status"]["podIP"] for i, p in result.pods.items()}
        worker_args = kube.api.get(
            f"/api/v1/namespaces/{ns}/pods/{result.pods[0]['metadata']['name']}")["spec"]["containers"][0]["args"]
    elapsed = time.monotonic() - started

    launcher = flags(worker_args)
    assert launcher["--node-rank"] == "$(JOB_COMPLETION_INDEX)"  # expanded by the kubelet, per pod
    at = rank0_log.find("distlib train_dp report")
    assert at >= 0, f"no report in the log of the pod with completion index 0:\n{rank0_log}"
    text = rank0_log[at:]
    print(f"\n[{mode}] {nodes} pods x {nproc} = {world} ranks on Kubernetes 1.20, job {result.seconds:.1f} s, "
          f"install to report {elapsed:.1f} s\n{text}")
    assert "RESULT: PASS" in text, rank0_log
    assert text.startswith(f"distlib train_dp report — run {run_id}:"), (
        f"the run id is not <release>-<revision>-<Job uid> {run_id} (the downward API chain): {text[:120]}")
    assert report_json is not None, f"rank 0 wrote no report at {path}"
    report = json.loads(report_json)
    assert report["ok"] is True
    run = report["run"]
    assert run["world_size"] == world
    assert run["nodes"] == nodes
    assert run["run_id"] == run_id
    if mode == "tcp":
        endpoint = launcher["--rdzv-endpoint"]
        assert endpoint == f"{RELEASE}-distlib-master.{ns}.svc.cluster.local:29500"
        assert run["init"] == f"env:// through the master service at {endpoint}"
        assert ready_s is not None and ready_s < 60
    elif mode == "rank0":
        pod0 = f"{job_name}-0.{job_name}.{ns}.svc.cluster.local"  # through the headless Service
        assert launcher["--master-addr"] == pod0 and launcher["--master-port"] == "29500"
        assert run["init"] == f"env:// with rank 0 hosting the store at {pod0}:29500"
    else:
        assert run["init"] == f"file:// FileStore /shared/{run_id}/store"
        assert "--rdzv-endpoint" not in launcher and "--master-addr" not in launcher

    ranks = sorted(report["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == list(range(world))
    for r in ranks:
        node = r["rank"] // nproc
        assert r["node_rank"] == node, r
        assert r["local_rank"] == r["rank"] % nproc, r
        assert r["host"] == f"{job_name}-{node}", f"rank {r['rank']} not on pod hostname {job_name}-{node}: {r}"
        # the address it advertised is its pod's IP, and a reverse lookup of it names that pod;
        # or "-": the rank that looked it up did so before the pod's IP was in the headless
        # Service's Endpoints (the kubelet reports a pod's IP about a second after it starts,
        # and cluster DNS serves Endpoints: file mode's ranks need no master and get there first)
        assert r["address"].rsplit(":", 1)[0] == pod_ips[node], (r, pod_ips)
        assert r["dns_name"] in (r["host"], "-"), r
    weights = report["weights"]
    assert weights["identical"] is True and len(set(weights["sha256"])) == 1
    assert len(weights["sha256"]) == world
    epochs = report["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(1, EPOCHS + 1))
    assert all(math.isfinite(e["loss"]) and e["loss"] > 0 for e in epochs), epochs
    assert epochs[-1]["loss"] < epochs[0]["loss"] * 1.5, epochs


def _wait_master_ready(kube: Any, ns: str) -> float:
    """Seconds from the master pod's creation to its Ready condition (the readiness probe)."""
    def ready() -> float | None:
        kube.check()
        for p in _lane.pods(kube, ns, "master"):
            for c in p["status"].get("conditions", []):
                if c["type"] == "Ready" and c["status"] == "True":
                    return max(0.001, _lane.parse_time(c["lastTransitionTime"])
                               - _lane.parse_time(p["metadata"]["creationTimestamp"]))
        return None

    return float(kube.api.wait(f"the master pod of {ns} Ready", ready, 90))


def _check_master(kube: Any, ns: str, docker_client: Any) -> None:
    """The master pod: never restarted (its liveness probe held), and a client without the
    chart's token refused."""
    (master,) = _lane.pods(kube, ns, "master")
    (status,) = master["status"]["containerStatuses"]
    assert status["restartCount"] == 0 and status["ready"], status
    probe = master["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    ctr = _lane.docker_container(docker_client, master, "store-server")
    code, out = ctr.exec_run(["env", "-u", "DISTLIB_AUTH_TOKEN_FILE", *probe])
    refused = out.decode("utf-8", "replace")
    assert code == 1 and "requires authentication" in refused, refused


def test_wrong_master_name_fails_clearly(helm: Any, kube_chart: Any, kube: Any, distlib_image: str) -> None:
    """A master Service name nobody publishes (an external endpoint with a typo): the ``helm
    test`` ping fails naming the host:port that does not resolve, and the workers wait for it,
    naming it, until the Job's deadline stops them."""
    with _lane.namespace(kube) as ns:
        wrong = f"distlib-mastr.{ns}.svc.cluster.local:29500"
        values = values_for("tcp", distlib_image)
        values.update(nodes=2, nprocPerNode=1)
        values["master"] = {"externalEndpoint": wrong}
        values["auth"] = {"enabled": False}
        values["workers"] = {"activeDeadlineSeconds": 20, "terminationGracePeriodSeconds": 5}
        release = _lane.install(helm, kube, kube_chart, ns, values)
        assert not [d for d in _manifest_docs(release) if d["kind"] == "Deployment"]
        waiting = f"waiting for the master service (distlib store-server) at {wrong}"

        def all_waiting() -> bool:
            kube.check()
            workers = [p for p in _lane.pods(kube, ns, "worker") if p["status"].get("phase") == "Running"]
            return len(workers) == 2 and all(waiting in _lane.logs(kube, p, "worker") for p in workers)

        kube.api.wait(f"both workers of {ns} to log {waiting!r}", all_waiting, 60)
        with _lane.helm_config(helm, kube, ns) as cfg:
            with pytest.raises(helm.HelmError) as ping:
                cfg.test(RELEASE, timeout=60, logs=True)
        # the failed test pod stays (hook-delete-policy: hook-succeeded): its log says why
        (ping_pod,) = _lane.pods(kube, ns, "test")
        ping_log = _lane.logs(kube, ping_pod, "ping").strip()
        job_name = f"{RELEASE}-distlib-workers"
        result = _lane.wait_job(kube, ns, job_name)
    print(f"\n[wrong master] helm test: {ping.value}\n[wrong master] ping pod: {ping_log}"
          f"\n[wrong master] job: {result.condition}")
    assert wrong in ping_log and "not resolved" in ping_log, ping_log
    assert result.condition == "Failed: DeadlineExceeded", result.job.get("status")
