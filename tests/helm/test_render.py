"""The chart rendered with Helm's engine for every rendezvous mode and the GPU values file: the
objects, what each worker runs and with which environment, the DNS names against the Services
that are actually rendered, volumes, GPU fields, security, labels and NOTES.txt."""

from __future__ import annotations

import re
from typing import Any

import pytest

from ._chart import (
    NAMESPACE,
    RELEASE,
    REVISION,
    SCENARIOS,
    STANDARD_LABELS,
    Rendered,
    expand_container,
    flags,
    job_pod,
    kn,
    matches,
    program,
    render,
    scenario_values,
)

JOB_UID = "0f6c3b2e-5d7a-4c1e-9b8f-2a4d6e8c0b1a"
MODES = {
    "tcp": "tcp",
    "tcp-external-master": "tcp",
    "rank0": "rank0",
    "file-claim": "file",
    "file-nfs": "file",
    "gpu": "tcp",
}
PING = ["distlib", "store-server", "--ping", "127.0.0.1:29500", "--timeout", "2"]
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@pytest.fixture(scope="module", params=list(SCENARIOS))
def scenario(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def rendered(chart: Any, scenario: str) -> Rendered:
    return render(chart, scenario_values(scenario))


def _service_host_port(r: Rendered, svc: dict[str, Any], port_name: str) -> tuple[str, int]:
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == port_name]
    return r.dns(svc["metadata"]["name"]), port["port"]


def _container_port(pod: dict[str, Any], name: str) -> int:
    ports = [
        p["containerPort"]
        for c in pod["containers"]
        for p in c.get("ports", [])
        if p["name"] == name
    ]
    assert len(ports) == 1, f"container port {name!r}: {ports}"
    return ports[0]


# --- objects


def test_objects_per_mode(rendered: Rendered, scenario: str) -> None:
    kinds = sorted(
        kn(d).split("/")[0] + ":" + d["metadata"]["labels"]["app.kubernetes.io/component"]
        for d in rendered.docs
    )
    own_master = scenario in ("tcp", "gpu")
    expected = ["Job:worker", "Service:worker"] + (
        ["Deployment:master", "Service:master", "PersistentVolumeClaim:master"] if own_master else []
    )
    if not rendered.values.get("auth", {}).get("existingSecret"):
        expected.append("Secret:auth")  # the token (auth.enabled, the default)
    if MODES[scenario] == "tcp":
        expected.append("Pod:test")  # the `helm test` hook
    if rendered.values.get("auth", {}).get("enabled", True):  # on with the token (test_network_policy.py)
        expected += ["NetworkPolicy:worker"] + (["NetworkPolicy:master"] if own_master else [])
    assert kinds == sorted(expected)
    for d in rendered.docs:
        assert d["metadata"]["namespace"] == NAMESPACE


def test_job_spec(rendered: Rendered) -> None:
    spec = rendered.job["spec"]
    nodes = rendered.values.get("nodes", 2)
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == nodes
    assert spec["backoffLimit"] == 0, "one failed rank must fail the job"
    assert "selector" not in spec and "manualSelector" not in spec
    pod = rendered.worker_pod
    assert pod["restartPolicy"] == "Never"
    assert pod["subdomain"] == rendered.headless["metadata"]["name"]
    worker = rendered.worker
    assert worker["command"] == ["distlib-run"]
    assert worker["image"] == "{repository}:{tag}".format(
        **{"repository": "distlib", "tag": "cpu", **rendered.values.get("image", {})}
    )
    assert worker["imagePullPolicy"] == "IfNotPresent"


def test_job_lifetime_values(chart: Any) -> None:
    r = render(chart)
    assert "ttlSecondsAfterFinished" not in r.job["spec"]
    assert "activeDeadlineSeconds" not in r.job["spec"]
    r = render(
        chart,
        {
            "workers": {
                "ttlSecondsAfterFinished": 0,
                "activeDeadlineSeconds": 600,
                "backoffLimit": 2,
            }
        },
    )
    assert (
        r.job["spec"]["ttlSecondsAfterFinished"] == 0
    )  # 0 is a value (delete at once), not "unset"
    assert r.job["spec"]["activeDeadlineSeconds"] == 600
    assert r.job["spec"]["backoffLimit"] == 2


# --- worker command line


def test_worker_command_line(rendered: Rendered, scenario: str) -> None:
    args = rendered.worker["args"]
    f = flags(args)
    v = rendered.values
    assert f["--nnodes"] == str(v.get("nodes", 2))
    assert f["--nproc-per-node"] == str(v.get("nprocPerNode", 1))
    assert f["--node-rank"] == "$(JOB_COMPLETION_INDEX)"
    assert f["--run-id"] == "$(DISTLIB_RUN_ID)"
    assert program(args) == ["distlib_deploy.jobs.train_dp"]
    mode = MODES[scenario]
    if mode == "tcp":
        assert f["--rdzv-backend"] == "c10d"
        assert "--master-addr" not in f and "--master-port" not in f
    elif mode == "rank0":
        assert f["--rdzv-backend"] == "static"
        assert "--rdzv-endpoint" not in f
    else:
        assert f["--rdzv-backend"] == "static"
        assert not {"--rdzv-endpoint", "--master-addr", "--master-port"} & set(
            f
        ), "file mode has no TCP store"


def test_job_module_and_args(chart: Any) -> None:
    r = render(
        chart,
        {
            "job": {
                "module": "mypkg.train",
                "args": ["--steps", "200", "--report-json", "/tmp/r.json"],
            }
        },
    )
    assert program(r.worker["args"]) == [
        "mypkg.train",
        "--steps",
        "200",
        "--report-json",
        "/tmp/r.json",
    ]


def test_dns_names_match_rendered_services(rendered: Rendered, scenario: str) -> None:
    """The names in the workers' arguments are those of the Services and pods actually rendered."""
    f = flags(rendered.worker["args"])
    headless = rendered.headless
    job = rendered.job
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert matches(
        headless["spec"]["selector"], pod_labels
    ), "the headless Service must select the workers"
    assert rendered.worker_pod["subdomain"] == headless["metadata"]["name"]

    if scenario == "rank0":
        # Pod 0's hostname is "<job>-0"; its subdomain is the headless Service.
        pod0 = job_pod(rendered, 0, JOB_UID)
        assert f["--master-addr"] == rendered.dns(pod0["hostname"], headless["metadata"]["name"])
        host, port = _service_host_port(rendered, headless, "store")
        assert int(f["--master-port"]) == port == _container_port(rendered.worker_pod, "store")
    elif scenario == "tcp-external-master":
        assert f["--rdzv-endpoint"] == rendered.values["master"]["externalEndpoint"]
    elif MODES[scenario] == "tcp":
        svc = rendered.one("Service", "master")
        deploy = rendered.one("Deployment", "master")
        host, port = _service_host_port(rendered, svc, "store")
        assert f["--rdzv-endpoint"] == f"{host}:{port}"
        # The Service reaches the store-server's port, and selects the master pods only.
        master_pod = deploy["spec"]["template"]
        (svc_port,) = svc["spec"]["ports"]
        assert svc_port["targetPort"] == "store"
        assert _container_port(master_pod["spec"], "store") == port
        assert matches(svc["spec"]["selector"], master_pod["metadata"]["labels"])
        assert not matches(svc["spec"]["selector"], pod_labels)
        assert not matches(headless["spec"]["selector"], master_pod["metadata"]["labels"])
        assert matches(deploy["spec"]["selector"]["matchLabels"], master_pod["metadata"]["labels"])
    else:
        assert "ports" not in headless["spec"]


def test_cluster_domain_value(chart: Any) -> None:
    for mode in ("tcp", "rank0"):
        r = render(chart, {"mode": mode, "clusterDomain": "k8s.example"})
        f = flags(r.worker["args"])
        addr = f.get("--rdzv-endpoint", f.get("--master-addr"))
        assert ".ml.svc.k8s.example" in addr, addr
        assert "cluster.local" not in addr


# --- each worker's environment


def test_each_worker_environment(rendered: Rendered, scenario: str) -> None:
    """Play the Job controller and the kubelet for every completion index: expand $(VAR) in the
    env and the args as Kubernetes does, and check what each pod runs."""
    nodes = rendered.values.get("nodes", 2)
    mode = MODES[scenario]
    run_id = f"{RELEASE}-{REVISION}-{JOB_UID}"
    argvs = []
    for index in range(nodes):
        pod = job_pod(rendered, index, JOB_UID)
        env, argv = expand_container(rendered.worker, pod["fields"], pod["injected"])
        # The chart defines JOB_COMPLETION_INDEX itself (from the pod's completion-index
        # annotation): the same argv without the controller's variable.
        assert expand_container(rendered.worker, pod["fields"], {}) == (env, argv)
        argvs.append(argv)
        assert not [a for a in argv if "$(" in a], f"unexpanded reference in {argv}"
        f = flags(argv[1:])
        assert f["--node-rank"] == str(index)
        assert f["--run-id"] == run_id == env["DISTLIB_RUN_ID"]
        assert env["DISTLIB_BACKEND"] == rendered.values.get("backend", "gloo")
        assert env["PYTHONUNBUFFERED"] == "1"
        if mode == "file":
            mount = rendered.values.get("file", {}).get("mountPath", "/shared")
            assert env["DISTLIB_INIT_METHOD"] == f"file://{mount}/{run_id}/store"
        else:
            assert "DISTLIB_INIT_METHOD" not in env
        # The rendezvous is not what the environment of the pods decides: no MASTER_* from the chart.
        assert not {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"} & set(env)
    # Every pod runs the same command but for its node rank.
    for argv in argvs:
        argv[argv.index("--node-rank") + 1] = "N"
    assert all(argv == argvs[0] for argv in argvs)


def test_run_id_differs_between_installs(chart: Any) -> None:
    a = render(chart, release="alpha", revision=1)
    b = render(chart, release="beta", revision=1)
    c = render(chart, release="alpha", revision=2)
    ids = set()
    for r, uid in ((a, "uid-a"), (b, "uid-b"), (c, "uid-c")):
        env, _ = expand_container(
            r.worker, job_pod(r, 0, uid)["fields"], {"JOB_COMPLETION_INDEX": "0"}
        )
        ids.add(env["DISTLIB_RUN_ID"])
    assert ids == {"alpha-1-uid-a", "beta-1-uid-b", "alpha-2-uid-c"}
    # The same release name and revision after an uninstall: a new Job, a new uid, a new run id.
    env1, _ = expand_container(a.worker, job_pod(a, 0, "uid-1")["fields"], {})
    env2, _ = expand_container(a.worker, job_pod(a, 0, "uid-2")["fields"], {})
    assert env1["DISTLIB_RUN_ID"] != env2["DISTLIB_RUN_ID"]


def test_explicit_run_id(chart: Any) -> None:
    r = render(chart, {"runId": "exp-42", "mode": "file", "file": {"existingClaim": "rwx"}})
    env, argv = expand_container(
        r.worker, job_pod(r, 1, JOB_UID)["fields"], {"JOB_COMPLETION_INDEX": "1"}
    )
    assert env["DISTLIB_RUN_ID"] == "exp-42"
    assert flags(argv[1:])["--run-id"] == "exp-42"
    assert env["DISTLIB_INIT_METHOD"] == "file:///shared/exp-42/store"


def test_network_and_extra_env(chart: Any) -> None:
    r = render(chart)
    names = [e["name"] for e in r.worker["env"]]
    assert "GLOO_SOCKET_IFNAME" not in names and "DISTLIB_PORT_RANGE" not in names
    extra = [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "NCCL_IB_DISABLE", "value": "1"}]
    r = render(
        chart,
        {
            "network": {"socketIfname": "eth0", "portRange": "30000-30100"},
            "workers": {"extraEnv": extra},
        },
    )
    env, _ = expand_container(r.worker, job_pod(r, 0, JOB_UID)["fields"], {})
    assert env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["DISTLIB_PORT_RANGE"] == "30000-30100"
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_IB_DISABLE"] == "1"
    names = [e["name"] for e in r.worker["env"]]
    assert names[-2:] == [
        "NCCL_DEBUG",
        "NCCL_IB_DISABLE",
    ], "extraEnv comes last (it may use the chart's variables)"
    assert len(names) == len(set(names))


# --- master


def test_master_store_server_and_probes(chart: Any) -> None:
    r = render(chart, {"masterPort": 29600})
    deploy = r.one("Deployment", "master")
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}, "never two store servers at once"
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] + c["args"] == [
        "distlib",
        "store-server",
        "--host",
        "0.0.0.0",
        "--port",
        "29600",
        "--state-dir",
        "/var/lib/distlib/master",
        "--sync",
        "turn",
    ]
    ping = ["distlib", "store-server", "--ping", "127.0.0.1:29600", "--timeout", "2"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"] == ping
        assert c[probe]["timeoutSeconds"] > 2, "the probe must outlast the ping's own timeout"
    # the port opens only once the journal is replayed: the startup probe connects to it, and
    # holds the liveness probe off for as long as a large journal takes (10 min by default)
    assert c["startupProbe"]["tcpSocket"] == {"port": "store"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, startup
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert flags(r.worker["args"])["--rdzv-endpoint"].endswith(":29600")


def _state_volume(r: Rendered) -> dict[str, Any]:
    pod = r.one("Deployment", "master")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/var/lib/distlib/master"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


def test_master_state_on_a_claim_of_the_release(chart: Any) -> None:
    """By default the master's --state-dir is a ReadWriteOnce claim the chart makes (deleted
    with the release); storageClass "" leaves the class to the cluster's default, "-" asks for
    none (a PersistentVolume made by hand), a name asks for that class."""
    r = render(chart)
    claim = r.one("PersistentVolumeClaim", "master")
    assert _state_volume(r) == {"name": "state", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}
    assert claim["metadata"]["name"] == f"{RELEASE}-distlib-master-state"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert "storageClassName" not in claim["spec"], "empty: the cluster's default class"
    assert "helm.sh/resource-policy" not in claim["metadata"].get("annotations", {}), "uninstall deletes it"
    none = render(chart, {"master": {"persistence": {"storageClass": "-", "size": "5Gi"}}})
    assert none.one("PersistentVolumeClaim", "master")["spec"]["storageClassName"] == ""
    assert none.one("PersistentVolumeClaim", "master")["spec"]["resources"]["requests"]["storage"] == "5Gi"
    fast = render(chart, {"master": {"persistence": {"storageClass": "fast-ssd",
                                                     "accessModes": ["ReadWriteOncePod"]}}})
    assert fast.one("PersistentVolumeClaim", "master")["spec"]["storageClassName"] == "fast-ssd"
    assert fast.one("PersistentVolumeClaim", "master")["spec"]["accessModes"] == ["ReadWriteOncePod"]


def test_master_state_on_an_existing_claim_or_an_empty_dir(chart: Any) -> None:
    """existingClaim: that claim, and the chart makes none; persistence off: an emptyDir (kept
    across container restarts, not pods), no claim, and the server still journals."""
    mine = render(chart, {"master": {"persistence": {"existingClaim": "my-master-state"}}})
    assert mine.maybe("PersistentVolumeClaim", "master") is None
    assert _state_volume(mine)["persistentVolumeClaim"] == {"claimName": "my-master-state"}
    off = render(chart, {"master": {"persistence": {"enabled": False}}})
    assert off.maybe("PersistentVolumeClaim", "master") is None
    assert _state_volume(off) == {"name": "state", "emptyDir": {}}
    (c,) = off.one("Deployment", "master")["spec"]["template"]["spec"]["containers"]
    assert c["args"][-4:] == ["--state-dir", "/var/lib/distlib/master", "--sync", "turn"]
    (c,) = render(chart, {"master": {"persistence": {"sync": "none"}}}).one(
        "Deployment", "master")["spec"]["template"]["spec"]["containers"]
    assert c["args"][-2:] == ["--sync", "none"], "master.persistence.sync does not reach the server"
    for values in ({"mode": "rank0"}, {"master": {"externalEndpoint": "store.infra:29500"}, "auth": {"enabled": False}}):
        assert render(chart, values).maybe("PersistentVolumeClaim", "master") is None, values


def test_master_only_in_tcp_mode(chart: Any) -> None:
    assert render(chart).maybe("Deployment", "master") is not None
    for values in (
        {"mode": "rank0"},
        {"mode": "file", "file": {"existingClaim": "rwx"}},
        {"master": {"externalEndpoint": "store.infra:29500"}, "auth": {"enabled": False}},
    ):
        r = render(chart, values)
        assert (
            r.maybe("Deployment", "master") is None and r.maybe("Service", "master") is None
        ), values


def test_master_probe_defaults(chart: Any) -> None:
    for scenario in ("tcp", "gpu"):
        deploy = render(chart, scenario_values(scenario)).one("Deployment", "master")
        (c,) = deploy["spec"]["template"]["spec"]["containers"]
        assert c["readinessProbe"]["exec"]["command"] == PING
        assert c["livenessProbe"]["exec"]["command"] == PING
        assert (
            c["livenessProbe"]["initialDelaySeconds"] >= c["readinessProbe"]["initialDelaySeconds"]
        )


def test_helm_test_pings_what_the_workers_use(rendered: Rendered, scenario: str) -> None:
    """`helm test` pings the master service at the endpoint the workers are given (tcp mode)."""
    tests = [
        d
        for d in rendered.of_kind("Pod")
        if d["metadata"]["annotations"].get("helm.sh/hook") == "test"
    ]
    if MODES[scenario] != "tcp":
        assert tests == []
        return
    (pod,) = tests
    (c,) = pod["spec"]["containers"]
    endpoint = flags(rendered.worker["args"])["--rdzv-endpoint"]
    assert c["command"] == ["distlib", "store-server", "--ping", endpoint, "--timeout", "10"]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert "hook-succeeded" in pod["metadata"]["annotations"]["helm.sh/hook-delete-policy"]


# --- volumes


def test_shm_volume(rendered: Rendered) -> None:
    pod = rendered.worker_pod
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    size = rendered.values.get("workers", {}).get("shm", {}).get("sizeLimit", "1Gi")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": size}
    mounts = {m["name"]: m for m in rendered.worker["volumeMounts"]}
    assert mounts["shm"]["mountPath"] == "/dev/shm"


def test_file_mode_volume(rendered: Rendered, scenario: str) -> None:
    pod = rendered.worker_pod
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in rendered.worker["volumeMounts"]}
    # the token's volume (auth.enabled, the default in every scenario) is checked by test_auth.py
    volumes.pop("auth-token")
    mounts.pop("auth-token")
    if MODES[scenario] != "file":
        assert set(volumes) == {"shm"} and set(mounts) == {"shm"}
        assert "initContainers" not in pod
        return
    file_values = rendered.values["file"]
    store = volumes["store"]
    if scenario == "file-claim":
        assert store == {"name": "store", "persistentVolumeClaim": {"claimName": "shared-rwx"}}
    else:
        assert store == {
            "name": "store",
            "nfs": {"server": "nfs.storage.example", "path": "/exports/distlib"},
        }
    assert mounts["store"]["mountPath"] == "/shared"
    assert mounts["store"].get("subPath") == file_values.get("subPath")
    assert "readOnly" not in mounts["store"]
    # The init container makes the run's directory, which the init method points into.
    (init,) = pod["initContainers"]
    assert init["volumeMounts"] == [mounts["store"]]  # not the token: mkdir needs none
    fields = job_pod(rendered, 0, JOB_UID)["fields"]
    env, argv = expand_container(init, fields, {})
    worker_env, _ = expand_container(rendered.worker, fields, {})
    assert argv == ["mkdir", "-p", f"/shared/{env['DISTLIB_RUN_ID']}"]
    assert worker_env["DISTLIB_INIT_METHOD"] == f"file://{argv[2]}/store"
    assert init["securityContext"] == rendered.worker["securityContext"]


def test_file_mode_mount_path(chart: Any) -> None:
    r = render(
        chart, {"mode": "file", "file": {"existingClaim": "rwx", "mountPath": "/data/distlib/"}}
    )
    env, _ = expand_container(r.worker, job_pod(r, 0, JOB_UID)["fields"], {})
    assert (
        env["DISTLIB_INIT_METHOD"] == f"file:///data/distlib/{RELEASE}-{REVISION}-{JOB_UID}/store"
    )
    assert {m["mountPath"] for m in r.worker["volumeMounts"]} == {"/dev/shm", "/data/distlib/",
                                                                  "/run/secrets/distlib"}


def test_run_id_usable_in_job_args(chart: Any) -> None:
    """job.args may name the run's directory: the kubelet expands $(DISTLIB_RUN_ID) there too."""
    r = render(
        chart,
        {
            "mode": "file",
            "file": {"existingClaim": "rwx"},
            "job": {"args": ["--report-json", "/shared/$(DISTLIB_RUN_ID)/report.json"]},
        },
    )
    _, argv = expand_container(
        r.worker, job_pod(r, 0, JOB_UID)["fields"], {"JOB_COMPLETION_INDEX": "0"}
    )
    assert program(argv)[1:] == [
        "--report-json",
        f"/shared/{RELEASE}-{REVISION}-{JOB_UID}/report.json",
    ]


# --- GPU node pools


def test_gpu_fields(chart: Any) -> None:
    values = scenario_values("gpu")
    r = render(chart, values)
    pod = r.worker_pod
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == values["workers"]["nodeSelector"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["affinity"] == values["workers"]["affinity"]
    limits = r.worker["resources"]["limits"]
    assert (
        limits["nvidia.com/gpu"]
        == values["nprocPerNode"]
        == int(flags(r.worker["args"])["--nproc-per-node"])
    )
    env = {e["name"]: e.get("value") for e in r.worker["env"]}
    assert env["DISTLIB_BACKEND"] in ("nccl", "cpu:gloo,cuda:nccl")
    assert env["NCCL_DEBUG"] == "WARN"
    # The master stays off the GPU pool and asks for no GPU.
    master = r.one("Deployment", "master")["spec"]["template"]["spec"]
    assert not {"runtimeClassName", "nodeSelector", "tolerations", "affinity"} & set(master)
    assert "nvidia.com/gpu" not in str(master["containers"][0]["resources"])


def test_cpu_only_defaults_have_no_gpu_fields(chart: Any) -> None:
    r = render(chart)
    pod = r.worker_pod
    assert not {
        "runtimeClassName",
        "nodeSelector",
        "tolerations",
        "affinity",
        "priorityClassName",
    } & set(pod)
    assert "nvidia.com/gpu" not in str(r.docs)
    env = {e["name"]: e.get("value") for e in r.worker["env"]}
    assert env["DISTLIB_BACKEND"] == "gloo"


def test_scheduling_values_pass_through(chart: Any) -> None:
    tol = [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]
    aff = {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}},
                    },
                }
            ]
        }
    }
    r = render(
        chart,
        {
            "imagePullSecrets": [{"name": "regcred"}],
            "workers": {
                "nodeSelector": {"pool": "gpu"},
                "tolerations": tol,
                "affinity": aff,
                "priorityClassName": "training",
                "podAnnotations": {"a": "b"},
                "podLabels": {"team": "ml"},
            },
            "master": {
                "nodeSelector": {"pool": "cpu"},
                "priorityClassName": "infra",
                "podLabels": {"team": "infra"},
            },
        },
    )
    w = r.worker_pod
    assert (w["nodeSelector"], w["tolerations"], w["affinity"], w["priorityClassName"]) == (
        {"pool": "gpu"},
        tol,
        aff,
        "training",
    )
    assert r.job["spec"]["template"]["metadata"]["annotations"] == {"a": "b"}
    assert r.job["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    m = r.one("Deployment", "master")["spec"]["template"]
    assert (
        m["spec"]["nodeSelector"] == {"pool": "cpu"} and m["spec"]["priorityClassName"] == "infra"
    )
    assert m["metadata"]["labels"]["team"] == "infra"
    for pod in r.pod_specs():
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_pod_labels_cannot_break_selectors(chart: Any) -> None:
    r = render(chart, {"workers": {"podLabels": {"app.kubernetes.io/component": "other"}}})
    labels = r.job["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "worker"
    assert matches(r.headless["spec"]["selector"], labels)


# --- security, labels, names


def test_security_context_non_root(rendered: Rendered) -> None:
    for pod in rendered.pod_specs():
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True
        assert sc["runAsUser"] == 1000 and sc["runAsGroup"] == 1000
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        # No service links: a Service named like "<x>-master" would otherwise inject
        # "<X>_MASTER_PORT=tcp://..." into the job's environment.
        assert pod["enableServiceLinks"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False
            assert csc["capabilities"] == {"drop": ["ALL"]}
            assert "privileged" not in csc


def test_standard_labels(rendered: Rendered) -> None:
    for d in rendered.docs:
        labels = d["metadata"]["labels"]
        assert set(STANDARD_LABELS) <= set(labels), kn(d)
        assert labels["app.kubernetes.io/name"] == "distlib"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["helm.sh/chart"] == "distlib-0.1.0"
        if d.get("metadata", {}).get("annotations", {}).get("helm.sh/hook") == "test":
            component = "test"
        elif d["kind"] == "Secret":
            component = "auth"
        else:
            component = "master" if d["metadata"]["name"].endswith(("-master", "-master-state")) else "worker"
        assert labels["app.kubernetes.io/component"] == component
        if d["kind"] in ("Job", "Deployment"):
            pod_labels = d["spec"]["template"]["metadata"]["labels"]
            assert {k: pod_labels[k] for k in STANDARD_LABELS} == {
                k: labels[k] for k in STANDARD_LABELS
            }


def test_two_releases_do_not_select_each_other(chart: Any) -> None:
    a, b = render(chart, release="alpha"), render(chart, release="beta")
    names_a = {kn(d) for d in a.docs}
    assert not names_a & {kn(d) for d in b.docs}
    assert not matches(
        a.headless["spec"]["selector"], b.job["spec"]["template"]["metadata"]["labels"]
    )
    assert not matches(
        a.one("Service", "master")["spec"]["selector"],
        b.one("Deployment", "master")["spec"]["template"]["metadata"]["labels"],
    )


@pytest.mark.parametrize("nodes", [1, 10, 1000])
def test_names_fit_kubernetes_limits(chart: Any, nodes: int) -> None:
    """A 53-character release (Helm's longest) still gives DNS-label names, pod hostnames
    "<job>-<last index>" within 63 characters, and label values Kubernetes accepts."""
    release = "a" * 40 + "-" + "b" * 12
    assert len(release) == 53
    for mode in ("tcp", "rank0"):
        r = render(chart, {"nodes": nodes, "mode": mode}, release=release)
        for d in r.docs:
            name = d["metadata"]["name"]
            assert DNS_LABEL.match(name) and len(name) <= 63, name
            for v in d["metadata"]["labels"].values():
                assert len(v) <= 63 and LABEL_VALUE.match(v), v
        last = job_pod(r, nodes - 1, JOB_UID)["hostname"]
        assert len(last) <= 63 and DNS_LABEL.match(last), last
        if mode == "rank0":
            addr = flags(r.worker["args"])["--master-addr"]
            assert addr.startswith(job_pod(r, 0, JOB_UID)["hostname"] + ".")
            assert len(addr) <= 253


def test_name_overrides(chart: Any) -> None:
    r = render(chart, {"fullnameOverride": "bert"})
    assert {kn(d) for d in r.docs} == {
        "Job/bert-workers",
        "Service/bert-workers",
        "Deployment/bert-master",
        "Service/bert-master",
        "PersistentVolumeClaim/bert-master-state",
        "Pod/bert-test-master",
        "Secret/bert-auth",
        "NetworkPolicy/bert-master",
        "NetworkPolicy/bert-workers",
    }
    r = render(chart, release="distlib-nightly")
    assert r.job["metadata"]["name"] == "distlib-nightly-workers"


# --- NOTES.txt


def test_notes(rendered: Rendered, scenario: str) -> None:
    notes = rendered.notes
    job = rendered.job["metadata"]["name"]
    ns = f"--namespace {NAMESPACE}"
    # How to follow the job, read every rank's log and the report of global rank 0 (completion index 0).
    assert f"kubectl {ns} wait --for=condition=complete job/{job}" in notes
    assert f"kubectl {ns} logs -f -l batch.kubernetes.io/job-name={job} --prefix --tail=-1" in notes
    assert (
        f"kubectl {ns} logs -l batch.kubernetes.io/job-name={job},batch.kubernetes.io/job-completion-index=0 --tail=-1"
        in notes
    )
    assert "report" in notes
    assert f"helm uninstall {RELEASE} {ns}" in notes
    assert f"get job {job} -o jsonpath='{RELEASE}-{REVISION}-{{.metadata.uid}}" in notes
    nodes = rendered.values.get("nodes", 2)
    nproc = rendered.values.get("nprocPerNode", 1)
    assert f"world size {nodes * nproc}" in notes
    mode = MODES[scenario]
    assert f"rendezvous: {mode}" in notes
    if scenario in ("tcp", "gpu"):
        assert flags(rendered.worker["args"])["--rdzv-endpoint"] in notes
        assert f"get deployment {rendered.one('Deployment', 'master')['metadata']['name']}" in notes
    if mode == "rank0":
        assert flags(rendered.worker["args"])["--master-addr"] in notes
    if mode == "file":
        assert "/shared/<run id>/store" in notes
        assert "--report-json /shared/$(DISTLIB_RUN_ID)/report.json" in notes
    if mode == "tcp":
        assert f"helm test {RELEASE} {ns}" in notes
    assert "WARNING" not in notes


def test_notes_warnings(chart: Any) -> None:
    r = render(chart, {"backend": "nccl"})
    assert (
        "WARNING: backend nccl uses NCCL, but workers.resources.limits has no nvidia.com/gpu"
        in r.notes
    )
    r = render(
        chart,
        {
            "backend": "nccl",
            "nprocPerNode": 4,
            "workers": {"resources": {"limits": {"nvidia.com/gpu": 2}}},
        },
    )
    assert "WARNING: nprocPerNode 4 is larger than the 2 GPU(s)" in r.notes
    r = render(chart, {"mode": "rank0", "master": {"externalEndpoint": "store:29500"}})
    assert "WARNING: master.externalEndpoint is used in tcp mode only" in r.notes
