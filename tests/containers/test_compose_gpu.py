"""GPU=1 make cluster-up without a GPU to run it on: what can be checked on a host that has none.

* the merged Compose file of every mode under every Compose found: the workers reserve the
  host's GPUs (driver nvidia), run the cuda image with NCCL for cupy arrays, NCCL's sockets on
  the cluster network, NPROC_PER_NODE GPUs per worker; the master service asks for none;
* on this host (Docker engine without the NVIDIA Container Toolkit) `distlib cluster up` stops
  before it removes, builds or creates anything, with one line that says what it looked at;
* the engine's own refusal of the workers' GPU request, as the post-build probe meets it;
* the decisions in between (docker info's shapes, the probe's facts, each worker's GPU slice).

A real GPU cluster run needs a GPU host: not here (docs/cluster.md says what has run).
"""

from __future__ import annotations

import time
import uuid

import pytest
import yaml

from distlib_deploy.cluster import engine, gpus
from distlib_deploy.cluster.config import LABEL
from distlib.command import ToolError
from distlib_deploy.jobs.compose_node import gpu_slice

from tests.support.compose import IMPLS, need_compose, run_cluster


def merged(tmp_path, impl: str, **env: str) -> dict:
    proc = run_cluster("config", tmp_path / "state", compose=IMPLS[impl], GPU="1", **env)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def environment(service: dict) -> dict:
    env = service.get("environment") or {}
    return dict(e.split("=", 1) for e in env) if isinstance(env, list) else env


@pytest.mark.parametrize("impl", sorted(IMPLS) or ["none"])
@pytest.mark.parametrize("mode", ["tcp", "rank0", "file"])
def test_the_workers_reserve_the_gpus_in_every_mode(tmp_path, impl, mode):
    need_compose()
    config = merged(tmp_path, impl, MODE=mode, NODES="2", NPROC_PER_NODE="4")
    worker = config["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert device["count"] in ("all", -1)  # v1 writes it as given, v2 as the engine's -1
    assert worker["image"] == "distlib:cuda"  # GPU=1's default image: what make image-gpu builds
    env = environment(worker)
    assert env["DISTLIB_BACKEND"] == "cpu:gloo,cuda:nccl"
    assert str(env["CLUSTER_GPUS_PER_NODE"]) == str(env["NPROC_PER_NODE"]) == "4"  # one GPU per process
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"  # the cluster network
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["DISTLIB_CLUSTER_MODE"] == mode
    assert str(worker["shm_size"]) in ("1g", "1073741824")
    for name, service in config["services"].items():
        if name != "worker":
            assert "deploy" not in service, f"{name} must not reserve GPUs"


def test_without_gpu_nothing_is_reserved(tmp_path):
    need_compose()
    impl = sorted(IMPLS)[0]
    proc = run_cluster("config", tmp_path / "state", compose=IMPLS[impl])
    assert proc.returncode == 0, proc.stderr
    worker = yaml.safe_load(proc.stdout)["services"]["worker"]
    assert "deploy" not in worker and worker["image"] == "distlib:cpu"
    assert "DISTLIB_BACKEND" not in environment(worker)


def test_gpu_image_can_be_named(tmp_path):
    need_compose()
    config = merged(tmp_path, sorted(IMPLS)[0], IMAGE="registry.example/ml/distlib:cuda-custom")
    assert config["services"]["worker"]["image"] == "registry.example/ml/distlib:cuda-custom"


@pytest.mark.containers
def test_up_on_a_host_without_the_nvidia_toolkit_stops_before_anything(tmp_path, docker_client):
    info = docker_client.info()
    if "nvidia" in (info.get("Runtimes") or {}) or info.get("DiscoveredDevices"):
        pytest.skip("this Docker engine has the NVIDIA Container Toolkit (or CDI devices): GPU=1 would go on")
    state_dir = tmp_path / "state"
    before = engine.labelled(docker_client, LABEL + "=1")
    proc = run_cluster("up", state_dir, GPU="1", SKIP_BUILD="0", MODE="tcp")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    runtimes = ", ".join(sorted(info["Runtimes"]))
    assert lines[0] == (
        "cluster: GPU=1 needs NVIDIA GPUs through the Docker engine, and the one at the default socket has no "
        "NVIDIA Container Toolkit: `docker info` lists no nvidia runtime and no CDI device nvidia.com/gpu=... "
        f"(runtimes {runtimes}; CDI devices none); install the NVIDIA Container Toolkit on the Docker host and run "
        "`nvidia-ctk runtime configure --runtime=docker` (then restart dockerd), or run without GPU=1")
    # nothing removed, built, recorded or created
    assert not state_dir.exists() or not any(state_dir.iterdir())
    assert engine.labelled(docker_client, LABEL + "=1") == before


@pytest.mark.containers
def test_the_engines_refusal_of_the_gpu_request_is_one_line(docker_client, distlib_image):
    """What the post-build probe meets on an engine whose dockerd has no nvidia-container-runtime-hook
    (on a host with the toolkit it would run distlib gpu-info --check instead). Any image will do:
    the engine refuses the request before the container's command runs."""
    if "nvidia" in (docker_client.info().get("Runtimes") or {}):
        pytest.skip("this Docker engine has the NVIDIA Container Toolkit")
    mine = f"distlib.test.probe={uuid.uuid4().hex}"  # this test's container, among other sessions'
    labels = {LABEL: "1", "distlib.test": "1", "distlib.test.probe": mine.split("=", 1)[1]}
    since = time.time() - 1
    with pytest.raises(ToolError) as refused:
        gpus.probe(docker_client, distlib_image, labels)
    text = str(refused.value)
    assert "\n" not in text
    assert text.startswith("GPU=1: the Docker engine refused a container with the workers' GPU request (driver "
                           "nvidia, all GPUs): "), text
    assert 'could not select device driver "nvidia"' in text and "NVIDIA Container Toolkit" in text
    # the probe's container was created (the engine refused to start it), then removed
    events = docker_client.events(since=since, until=time.time() + 1, decode=True,
                                  filters={"type": "container", "label": mine})
    actions = [e["Action"] for e in events]
    assert "create" in actions and "destroy" in actions, actions
    assert not docker_client.containers.list(all=True, filters={"label": mine})


# -- the decisions, on the shapes the engine and gpu-info give ------------------------------------


def test_docker_info_with_the_toolkit_or_cdi_devices_is_enough():
    assert gpus.engine_gpu_problem({"Runtimes": {"runc": {}, "nvidia": {"path": "nvidia-container-runtime"}}},
                                   "x") is None
    cdi = {"Runtimes": {"runc": {}}, "DiscoveredDevices": [{"Source": "cdi", "ID": "nvidia.com/gpu=0"}]}
    assert gpus.engine_gpu_problem(cdi, "x") is None
    other = {"Runtimes": {"runc": {}}, "DiscoveredDevices": [{"Source": "cdi", "ID": "vendor.com/fpga=0"}]}
    assert "(runtimes runc; CDI devices vendor.com/fpga=0)" in gpus.engine_gpu_problem(other, "tcp://gpu-host:2376")


def test_the_probe_facts_decide():
    facts = {"ok": True, "devices": ["cuda:0 A", "cuda:1 B", "cuda:2 C", "cuda:3 D"]}
    assert gpus.require(facts, "distlib:cuda", nodes=2, per_node=2) == 4
    with pytest.raises(ToolError, match=r"NODES=3 x NPROC_PER_NODE=2 needs 6 GPUs .* gives containers 4: lower"):
        gpus.require(facts, "distlib:cuda", nodes=3, per_node=2)
    broken = {"ok": False, "devices": ["cuda:0 A"], "problem": "check failed on cuda:0: CUDARuntimeError: x"}
    with pytest.raises(ToolError, match=r"cannot use a GPU: check failed on cuda:0: CUDARuntimeError: x$"):
        gpus.require(broken, "distlib:cuda", nodes=1, per_node=1)


def test_each_worker_gets_its_own_gpus():
    slices = [gpu_slice(slot, 2, visible=8, nodes=4) for slot in range(4)]
    assert slices == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gpu_slice(0, 1, visible=1, nodes=1) == [0]
    with pytest.raises(ToolError, match=r"worker 2 of 3 needs GPUs 4\.\.5, but this container sees 4 GPU\(s\): "
                                        r"NODES=3 x NPROC_PER_NODE=2 needs 6"):
        gpu_slice(2, 2, visible=4, nodes=3)
