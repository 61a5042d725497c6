"""The chart with values-gpu.yaml, followed down to each process: the image is the one `make
image-gpu` builds, every worker pod asks for nvidia.com/gpu and runs one process per GPU, and
each process (its environment as the real launcher makes it from the rendered command) binds
its group to cuda:LOCAL_RANK, a different GPU of its pod. Rendered with Helm's engine and
validated against the Kubernetes schemas by test_kube_validate.py (scenario "gpu")."""

from __future__ import annotations

import re
from typing import Any

import pytest

from distlib.launcher.resolve import Flags, Probe, resolve
from distlib.launcher.workerenv import worker_env
from distlib.run import build_parser
from distlib_deploy.cluster.config import DEFAULT_GPU_IMAGE
from distlib_deploy.jobs import _common as C

from ._chart import REPO, expand_container, job_pod, render, scenario_values

JOB_UID = "5b9d0c3e-1f2a-4e6b-8c7d-9a0b1c2d3e4f"


@pytest.fixture(scope="module")
def rendered(chart: Any):
    return render(chart, scenario_values("gpu"))


def test_the_image_is_what_make_image_gpu_builds(rendered):
    makefile = (REPO / "Makefile").read_text()
    default = re.search(r"^CUDA_IMAGE := \$\(if \$\(filter file,\$\(origin IMAGE\)\),([^,]+),", makefile, re.M)
    assert default and default.group(1) == DEFAULT_GPU_IMAGE == "distlib:cuda"
    assert rendered.worker["image"] == DEFAULT_GPU_IMAGE
    assert rendered.values["image"] == {"repository": "distlib", "tag": "cuda"}


def test_workers_ask_for_gpus_one_process_each(rendered):
    limits = rendered.worker["resources"]["limits"]
    gpus = int(limits["nvidia.com/gpu"])
    args = rendered.worker["args"]
    assert gpus == 8 and int(args[args.index("--nproc-per-node") + 1]) == gpus
    env = {e["name"]: e.get("value") for e in rendered.worker["env"]}
    assert C.runs_nccl(env["DISTLIB_BACKEND"])
    assert "WARNING" not in rendered.notes  # NOTES warns when the GPUs and the processes disagree


def _process_envs(rendered, index: int) -> list[dict[str, str]]:
    """Every process of pod ``index``: the pod's env (the kubelet's expansion), then what
    distlib-run, parsing the rendered command, sets for each local rank."""
    pod = job_pod(rendered, index, JOB_UID)
    env, argv = expand_container(rendered.worker, pod["fields"], pod["injected"])
    assert argv[0] == "distlib-run"
    args = build_parser().parse_args(argv[1:])
    flags = Flags(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, node_rank=args.node_rank,
                  master_addr=args.master_addr, master_port=args.master_port, rdzv_backend=args.rdzv_backend,
                  rdzv_endpoint=args.rdzv_endpoint, run_id=args.run_id, standalone=args.standalone)
    probe = Probe(cpu_count=lambda: 16, gpu_count=lambda environ: (8, "nvidia.com/gpu"), hostname=lambda: pod["hostname"])
    resolved = resolve(flags, env, probe)
    return [{**env, **worker_env(resolved, local)} for local in range(resolved.nproc_per_node.value)]


def test_each_process_binds_its_own_gpu_from_local_rank(rendered):
    gpus = int(rendered.worker["resources"]["limits"]["nvidia.com/gpu"])
    nodes = rendered.values["nodes"]
    ranks = []
    for index in range(nodes):
        envs = _process_envs(rendered, index)
        devices = [C.job_device(e["DISTLIB_BACKEND"], e) for e in envs]
        # the pod's GPUs are cuda:0..gpus-1 inside it (the device plugin exposes only those)
        assert devices == [int(e["LOCAL_RANK"]) for e in envs] == list(range(gpus))
        ranks += [int(e["RANK"]) for e in envs]
        assert {e["WORLD_SIZE"] for e in envs} == {str(nodes * gpus)}
    assert sorted(ranks) == list(range(nodes * gpus))


def test_gloo_jobs_bind_no_gpu():
    assert C.job_device("gloo", {"LOCAL_RANK": "3"}) is None
    assert C.job_device("nccl", {}) == 0
    assert C.job_device("cpu:gloo,cuda:nccl", {"LOCAL_RANK": "5"}) == 5


def test_under_srun_the_job_binds_the_gpu_of_its_slurm_local_id():
    """`srun python -m distlib_deploy.jobs.train_dp`, one task per GPU: nobody sets LOCAL_RANK,
    and init writes none; the task's local id on its node is SLURM_LOCALID."""
    step = {"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_NTASKS": "8",
            "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
            "SLURM_STEP_NODELIST": "node[01-02]"}
    assert C.job_device("nccl", step, devices=4) == 2
    assert C.job_device("nccl", {**step, "LOCAL_RANK": "3"}, devices=4) == 3  # a launcher's word wins


def test_notes_warn_when_gpus_and_processes_disagree(chart):
    values = scenario_values("gpu")
    values["nprocPerNode"] = 4
    notes = render(chart, values).notes
    assert "WARNING: nprocPerNode 4 is smaller than the 8 GPU(s) each pod gets: 4 GPU(s) stay idle" in notes
