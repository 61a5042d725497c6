"""Run what the chart renders: its pods as Docker containers, and the training job to its report.

The chart is rendered with Helm's engine for a small install (the locally built image, short
training, ``--report-json`` under ``$(DISTLIB_RUN_ID)``), and ``_pods.py`` turns the manifests
into what Kubernetes would run — the master Deployment's pod (tcp mode), one pod per completion
index of the Indexed Job, the ``helm test`` pod — with the same image, command, args, env (the
downward API and ``$(VAR)`` expansion emulated), user and security options, each pod holding
the DNS names the Services would give it as network aliases on one private Docker network
(``<master svc>[.<ns>[.svc[.cluster.local]]]``, ``<job>-<i>.<job>[...]``). Then every worker
must exit 0 and global rank 0's report must show the whole world: every rank on the pod
hostname its node rank implies, identical weights, losses, the run id made of the Job's uid.
Modes tcp (with the master's readiness and liveness probes and the ``helm test`` pod, all
presenting the chart's token, and a client without it refused), file and rank0, each with the
token (auth.enabled, the default); and a wrong master name, which must fail clearly.

In file mode the chart's ReadWriteMany claim is played by ONE named Docker volume that every
worker container mounts: this substitutes for ReadWriteMany storage (an NFS export, EFS,
Filestore ...) — same-host sharing, with the same flock and rename semantics, not a network
file system.

What this proves is the chart's rendezvous wiring (names, ports, env, args, volumes), not
Kubernetes itself: scheduling, the Services' virtual IPs and kube-proxy are not involved. Every
feature of the manifests that ``_pods.py`` does not emulate makes it raise instead of skipping.
Needs Docker (the docker fixtures skip without it, fail under DISTLIB_REQUIRE_DOCKER=1).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from typing import Any

import pytest

from tests.fixtures.docker import labelled

from . import _pods
from ._chart import RELEASE, REVISION, flags, render

pytestmark = [pytest.mark.containers, pytest.mark.timeout(420)]

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
JOB_TIMEOUT_S = 240


def _image_values(image: str) -> dict[str, str]:
    repo, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        repo, tag = image, "latest"
    # Never: nothing may be pulled (there is no registry); _pods never pulls either way.
    return {"repository": repo, "tag": tag, "pullPolicy": "Never"}


def _namespace() -> str:
    """A namespace of its own per run: it is part of every DNS name and Docker container name."""
    return f"helmrun-{uuid.uuid4().hex[:8]}"


def _values(mode: str, image: str) -> dict[str, Any]:
    nodes, nproc = SHAPES[mode]
    values: dict[str, Any] = {
        "image": _image_values(image),
        "mode": mode,
        "nodes": nodes,
        "nprocPerNode": nproc,
        "job": {"args": JOB_ARGS + ["--report-json", REPORTS[mode]]},
    }
    if mode == "file":
        values["file"] = {"existingClaim": CLAIM}
    return values


def _try_read(container: Any, path: str) -> bytes | None:
    import docker

    try:
        return _pods.read_file(container, path)
    except docker.errors.NotFound:
        return None


@contextlib.contextmanager
def _cluster(plan: _pods.Plan, docker_client: Any, network: Any, container_factory: Any,
             rwx: bool) -> Any:
    """A Cluster for ``plan``; with ``rwx`` one named volume stands for the claim ``CLAIM``."""
    with contextlib.ExitStack() as stack:
        storage = {}
        if rwx:
            vol = docker_client.volumes.create(f"{plan.namespace}-{CLAIM}", labels=labelled())
            stack.callback(vol.remove, force=True)  # after the containers (ExitStack order)
            storage[f"pvc/{CLAIM}"] = vol.name
        yield stack.enter_context(
            _pods.Cluster(docker_client, container_factory, network, plan, storage, labels=labelled())
        )


@pytest.mark.parametrize("mode", ["tcp", "file", "rank0"])
def test_rendered_pods_run_the_job(mode: str, chart: Any, docker_client: Any, distlib_image: str,
                                   docker_network: Any, container_factory: Any) -> None:
    nodes, nproc = SHAPES[mode]
    world = nodes * nproc
    ns = _namespace()
    rendered = render(chart, _values(mode, distlib_image), namespace=ns)
    job_uid = str(uuid.uuid4())
    plan = _pods.plan(rendered.docs, ns, job_uid=job_uid)
    job_name = rendered.job["metadata"]["name"]
    run_id = f"{RELEASE}-{REVISION}-{job_uid}"

    # The wiring as Kubernetes would see it before anything runs: every Service selects pods.
    assert plan.endpoints, "no Services rendered"
    for svc, pods in plan.endpoints.items():
        assert pods, f"Service {svc} selects no pod: its DNS name would lead nowhere"
    assert [p.hostname for p in plan.job_pods] == [f"{job_name}-{i}" for i in range(nodes)]
    master_pods = [p for p in plan.pods if p.owner.startswith("Deployment/")]
    assert len(master_pods) == (1 if mode == "tcp" else 0)

    started = time.monotonic()
    with _cluster(plan, docker_client, docker_network(), container_factory, rwx=mode == "file") as cluster:
        cluster.start_all()
        if mode == "tcp":
            (master,) = master_pods
            ready_s = cluster.wait_ready(master, "store-server")
            code, out = cluster.probe(master, "store-server", "livenessProbe")
            assert code == 0, f"the master's liveness probe fails (Kubernetes would restart it): {out}"
            # auth.enabled (the default): the probes authenticate with the mounted Secret; a
            # client without it is refused
            code, out = cluster.running[master.name]["store-server"].exec_run(
                ["env", "-u", "DISTLIB_AUTH_TOKEN_FILE", *master.container("store-server").spec[
                    "readinessProbe"]["exec"]["command"]])
            refused = out.decode("utf-8", "replace")
            assert code == 1 and "requires authentication" in refused, refused
        result = cluster.wait_job("worker", JOB_TIMEOUT_S)
        if mode == "tcp":
            (ping,) = cluster.run_test_pods()  # `helm test`: raises unless the ping exits 0
            ping_log = ping.logs.strip()
        pod_ips = {p.completion_index: cluster.pod_ip(p) for p in plan.job_pods}
        # The report as rank 0 wrote it; in file mode read through the LAST pod's container: the
        # file is on the volume every pod shares.
        path = REPORTS[mode].replace("$(DISTLIB_RUN_ID)", run_id)
        reader = result.pods[nodes - 1 if mode == "file" else 0].docker
        report_json = _try_read(reader, path)
        rank0_log = result.pods[0].logs
    elapsed = time.monotonic() - started

    # What the worker ran: the launcher flags of the chart, with $(VAR)s expanded by "the kubelet".
    worker = plan.job_pods[0].container("worker").spec
    launcher = flags(worker["args"])
    assert launcher["--node-rank"] == "$(JOB_COMPLETION_INDEX)"  # expanded per pod, below

    at = rank0_log.find("distlib train_dp report")
    assert at >= 0, f"no report in the log of the pod with completion index 0:\n{rank0_log}"
    text = rank0_log[at:]
    if mode == "tcp":
        print(f"\n[tcp] helm test pod: {ping_log}")
    print(f"\n[{mode}] {nodes} pods x {nproc} = {world} ranks, job {result.seconds:.1f} s, "
          f"total {elapsed:.1f} s\n{text}")
    assert "RESULT: PASS" in text, rank0_log
    assert text.startswith(f"distlib train_dp report — run {run_id}:"), (
        f"the run id is not <release>-<revision>-<Job uid> {run_id} (the downward API chain): {text[:120]}")
    assert report_json is not None, f"rank 0 wrote no report at {path}"
    report = json.loads(report_json)

    assert report["ok"] is True
    run = report["run"]
    assert run["world_size"] == world
    assert run["nodes"] == nodes
    assert run["run_id"] == run_id, "run id is not <release>-<revision>-<Job uid> (downward API)"
    if mode == "tcp":
        endpoint = launcher["--rdzv-endpoint"]
        master_svc = rendered.one("Service", "master")["metadata"]["name"]
        assert endpoint == f"{master_svc}.{ns}.svc.cluster.local:29500"
        assert run["init"] == f"env:// through the master service at {endpoint}"
        assert 0 <= ready_s < 30
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
        # The address it advertised is its pod's, and a reverse lookup of it names that pod.
        assert r["address"].rsplit(":", 1)[0] == pod_ips[node], (r, pod_ips)
        assert r["dns_name"] == r["host"], r

    weights = report["weights"]
    assert weights["identical"] is True and len(set(weights["sha256"])) == 1
    assert len(weights["sha256"]) == world
    epochs = report["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(1, EPOCHS + 1))
    assert all(math.isfinite(e["loss"]) and e["loss"] > 0 for e in epochs), epochs
    assert epochs[-1]["loss"] < epochs[0]["loss"] * 1.5, epochs  # training, not diverging
    for i, e in result.pods.items():
        assert e.exit_code == 0, (i, e.logs)


def test_wrong_master_name_fails_clearly(chart: Any, docker_client: Any, distlib_image: str,
                                        docker_network: Any, container_factory: Any) -> None:
    """A master Service name nobody publishes (here: an external endpoint with a typo): the
    ``helm test`` ping says which host:port does not resolve, and the workers wait for it,
    naming it, until the Job's deadline stops them (the launcher alone would wait 300 s)."""
    ns = _namespace()
    wrong = f"distlib-mastr.{ns}.svc.cluster.local:29500"
    values = _values("tcp", distlib_image)
    values.update(nodes=2, nprocPerNode=1)
    values["master"] = {"externalEndpoint": wrong}
    values["auth"] = {"enabled": False}  # a shared server's token would come from auth.existingSecret
    values["workers"] = {"activeDeadlineSeconds": 12, "terminationGracePeriodSeconds": 5}
    rendered = render(chart, values, namespace=ns)
    plan = _pods.plan(rendered.docs, ns)
    assert not [p for p in plan.pods if p.owner.startswith("Deployment/")]

    with _cluster(plan, docker_client, docker_network(), container_factory, rwx=False) as cluster:
        cluster.start_all()
        with pytest.raises(_pods.PodFailed) as ping:
            cluster.run_test_pods()
        with pytest.raises(_pods.JobFailed) as failed:
            cluster.wait_job("worker", JOB_TIMEOUT_S)

    print(f"\n[wrong master] helm test: {ping.value}\n[wrong master] job: {failed.value.result.reason}")
    assert wrong in str(ping.value) and "not resolved" in str(ping.value), ping.value
    assert failed.value.result.reason == "DeadlineExceeded"
    for e in failed.value.result.pods.values():
        assert e.exit_code != 0
        assert f"waiting for the master service (distlib store-server) at {wrong}" in e.logs, e.logs
