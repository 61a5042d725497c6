"""resolve(flags, environ): every convention, precedence, contradictions and errors, with env dicts."""

from __future__ import annotations

import re

import pytest

from distlib.launcher.resolve import Flags, Probe, ResolveError, resolve
from distlib.launcher.workerenv import Program, worker_env


def probe(gpus: int = 0, cpus: int = 8, hostname: str = "testhost") -> Probe:
    return Probe(cpu_count=lambda: cpus, gpu_count=lambda env: (gpus, f"{gpus} fake GPU(s)"),
                 hostname=lambda: hostname)


def res(env=None, gpus=0, **flags):
    return resolve(Flags(**flags), env or {}, probe(gpus))


# -- defaults and flags ---------------------------------------------------------------------------


def test_defaults_are_torchruns():
    r = res()
    assert (r.nnodes.value, r.nproc_per_node.value, r.node_rank.value) == (1, 1, 0)
    assert (r.rdzv_backend.value, r.master_addr.value, r.master_port.value) == ("static", "127.0.0.1", 29500)
    assert r.run_id.value == "none"
    assert r.world_size == 1
    for v in (r.nnodes, r.nproc_per_node, r.node_rank, r.rdzv_backend, r.master_addr, r.master_port, r.run_id):
        assert v.source == "default"
    assert r.init_method is None and r.extra_env == {} and r.warnings == []


def test_flags_are_used_and_named():
    r = res(nnodes="2", nproc_per_node="3", node_rank="1", master_addr="m.example", master_port="1234",
            run_id="exp")
    assert (r.nnodes.value, r.nproc_per_node.value, r.node_rank.value) == (2, 3, 1)
    assert (r.master_addr.value, r.master_port.value, r.run_id.value) == ("m.example", 1234, "exp")
    assert r.nnodes.source == "flag --nnodes"
    assert r.nproc_per_node.source == "flag --nproc-per-node"
    assert r.master_port.source == "flag --master-port"
    assert r.world_size == 6


# -- torchrun's PET_* (Kubeflow Trainer) ---------------------------------------------------------

PET = {"PET_NNODES": "4", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "3", "PET_MASTER_ADDR": "trainer-node-0-0.t",
       "PET_MASTER_PORT": "29400", "PET_RDZV_ID": "train-42"}


def test_pet_variables():
    r = res(PET)
    assert (r.nnodes.value, r.nproc_per_node.value, r.node_rank.value) == (4, 2, 3)
    assert (r.master_addr.value, r.master_port.value, r.run_id.value) == ("trainer-node-0-0.t", 29400, "train-42")
    assert r.nnodes.source == "PET_NNODES" and r.node_rank.source == "PET_NODE_RANK"
    assert r.master_addr.source == "PET_MASTER_ADDR" and r.run_id.source == "PET_RDZV_ID"


def test_kubeflow_trainer_v2_pet_with_job_completion_index_agree():
    env = dict(PET, PET_NPROC_PER_NODE="auto", JOB_COMPLETION_INDEX="3")
    r = res(env, gpus=8)
    assert r.node_rank.value == 3 and r.node_rank.source == "PET_NODE_RANK"
    assert r.nproc_per_node.value == 8 and "GPU" in r.nproc_per_node.source
    assert r.warnings == ["setting OMP_NUM_THREADS=1 for each worker (it is unset and several workers share this "
                          "node), to avoid overloading the machine; set it yourself to tune"]


def test_flags_win_over_pet_with_a_note():
    r = res(PET, nnodes="8", node_rank="5", master_port="1000")
    assert (r.nnodes.value, r.node_rank.value, r.master_port.value) == (8, 5, 1000)
    assert r.nnodes.source == "flag --nnodes"
    assert any("PET_NNODES" in n and "the flag wins" in n for n in r.notes)
    assert any("PET_NODE_RANK" in n for n in r.notes)


def test_pet_rdzv_backend_and_endpoint():
    r = res({"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "master-svc:29400", "PET_RDZV_ID": "j"})
    assert r.c10d and r.rdzv_backend.source == "PET_RDZV_BACKEND"
    assert (r.master_addr.value, r.master_port.value) == ("master-svc", 29400)
    assert r.master_addr.source == "PET_RDZV_ENDPOINT"


def test_empty_variables_count_as_unset():
    r = res({"PET_NNODES": "", "PET_NODE_RANK": "  "})
    assert r.nnodes.source == "default" and r.node_rank.source == "default"


# -- Kubeflow PyTorchJob v1 (pod-level RANK/WORLD_SIZE) --------------------------------------------


def kubeflow(rank: int, world: int, **extra):
    env = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "RANK": str(rank), "WORLD_SIZE": str(world),
           "PYTHONUNBUFFERED": "0"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_kubeflow_v17_world_size_counts_processes_the_trap():
    # 4 pods x 2 processes: the operator says WORLD_SIZE=8 and RANK=2 for the pod "worker-1".
    env = kubeflow(2, 8, PET_NPROC_PER_NODE=2, PET_NODE_RANK=2, PET_NNODES=4)
    r = res(env)
    assert (r.nnodes.value, r.nproc_per_node.value, r.node_rank.value, r.world_size) == (4, 2, 2, 8)
    assert (r.master_addr.value, r.master_port.value) == ("job-master-0", 23456)
    assert r.master_addr.source == "MASTER_ADDR"
    # the workers get process ranks, not the pod's RANK
    assert [worker_env(r, local)["RANK"] for local in (0, 1)] == ["4", "5"]
    assert {worker_env(r, local)["WORLD_SIZE"] for local in (0, 1)} == {"8"}


def test_kubeflow_world_size_over_pet_nproc_without_pet_nnodes():
    r = res(kubeflow(1, 8, PET_NPROC_PER_NODE=4))
    assert (r.nnodes.value, r.nproc_per_node.value, r.node_rank.value) == (2, 4, 1)
    assert r.nnodes.source == "WORLD_SIZE=8 / PET_NPROC_PER_NODE=4 (WORLD_SIZE counts processes)"
    assert r.node_rank.source == "RANK (the pod's rank)"


def test_kubeflow_before_v17_world_size_counts_pods():
    r = res(kubeflow(1, 3), nproc_per_node="4")
    assert (r.nnodes.value, r.node_rank.value, r.world_size) == (3, 1, 12)
    assert "counts pods" in r.nnodes.source


def test_kubeflow_nproc_auto_means_world_size_counts_pods():
    # the operator counts 1 process per pod when nprocPerNode is not an integer
    r = res(kubeflow(0, 2, PET_NPROC_PER_NODE="auto", PET_NNODES=2, PET_NODE_RANK=0), gpus=4)
    assert (r.nnodes.value, r.nproc_per_node.value, r.world_size) == (2, 4, 8)


def test_kubeflow_world_size_not_divisible_is_an_error():
    with pytest.raises(ResolveError, match=r"WORLD_SIZE=6 is not divisible by PET_NPROC_PER_NODE=4"):
        res(kubeflow(0, 6, PET_NPROC_PER_NODE=4))


def test_kubeflow_not_divisible_but_nnodes_flag_given():
    r = res(kubeflow(0, 6, PET_NPROC_PER_NODE=4), nnodes="2")
    assert r.nnodes.value == 2 and r.nnodes.source == "flag --nnodes"


def test_kubeflow_contradiction_with_pet_nnodes():
    with pytest.raises(ResolveError, match=r"contradicts itself: nnodes: PET_NNODES gives 2, WORLD_SIZE=6"):
        res(kubeflow(0, 6, PET_NPROC_PER_NODE=1, PET_NNODES=2))


def test_rank_and_world_size_from_an_outer_launcher_are_ignored():
    r = res({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert r.node_rank.source == "default" and r.nnodes.source == "default"
    assert any("LOCAL_RANK is set" in n for n in r.notes)


# -- Kubernetes Indexed Job -----------------------------------------------------------------------


def test_indexed_job_gives_the_node_rank():
    r = res({"JOB_COMPLETION_INDEX": "1"}, nnodes="2")
    assert r.node_rank.value == 1 and r.node_rank.source == "JOB_COMPLETION_INDEX"


def test_indexed_job_without_nnodes_says_to_pass_it():
    with pytest.raises(ResolveError, match=r"node rank 1 \(from JOB_COMPLETION_INDEX\) is out of range for 1 "
                                           r"node.*pass --nnodes"):
        res({"JOB_COMPLETION_INDEX": "1"})


def test_helm_chart_command_line():
    env = {"JOB_COMPLETION_INDEX": "1", "DISTLIB_RUN_ID": "demo-1-abc", "DISTLIB_BACKEND": "gloo"}
    r = res(env, nnodes="2", nproc_per_node="1", node_rank="1", rdzv_backend="c10d",
            rdzv_endpoint="demo-distlib-master.ml.svc.cluster.local:29500", run_id="demo-1-abc")
    master = "demo-distlib-master.ml.svc.cluster.local"
    assert (r.node_rank.value, r.master_addr.value, r.master_port.value) == (1, master, 29500)
    assert r.c10d and r.warnings == [] and r.notes == []
    env = worker_env(r, 0)
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["DISTLIB_EXTERNAL_STORE"] == "1"
    assert env["TORCHELASTIC_RUN_ID"] == env["DISTLIB_RUN_ID"] == "demo-1-abc"


def test_helm_file_mode_passes_the_init_method():
    env = {"JOB_COMPLETION_INDEX": "0", "DISTLIB_INIT_METHOD": "file:///shared/r1/store"}
    r = res(env, nnodes="2", node_rank="0", rdzv_backend="static", run_id="r1")
    assert r.init_method.value == "file:///shared/r1/store" and r.init_method.source == "DISTLIB_INIT_METHOD"
    assert worker_env(r, 0)["DISTLIB_INIT_METHOD"] == "file:///shared/r1/store"


# -- LeaderWorkerSet ------------------------------------------------------------------------------


def test_leader_worker_set():
    env = {"LWS_LEADER_ADDRESS": "llm-0.llm.ns", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "3"}
    r = res(env)
    assert (r.nnodes.value, r.node_rank.value, r.master_addr.value) == (4, 3, "llm-0.llm.ns")
    assert (r.nnodes.source, r.node_rank.source, r.master_addr.source) == (
        "LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS")
    assert r.run_id.value == "lws-llm-0.llm.ns"
    assert r.master_port.value == 29500


def test_leader_worker_set_leader_is_node_zero():
    r = res({"LWS_LEADER_ADDRESS": "llm-1.llm.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"})
    assert r.node_rank.value == 0 and worker_env(r, 0)["RANK"] == "0"


# -- Volcano --------------------------------------------------------------------------------------


def test_volcano_one_task():
    env = {"VC_WORKER_HOSTS": "j-worker-0.j,j-worker-1.j,j-worker-2.j", "VC_WORKER_NUM": "3",
           "VC_TASK_INDEX": "2", "VK_TASK_INDEX": "2"}
    r = res(env)
    assert (r.nnodes.value, r.node_rank.value, r.master_addr.value) == (3, 2, "j-worker-0.j")
    assert (r.nnodes.source, r.node_rank.source) == ("VC_WORKER_NUM", "VC_TASK_INDEX")
    assert r.master_addr.source == "the first host of VC_WORKER_HOSTS"


def test_volcano_task_name_with_hyphen():
    env = {"VC_MY_TASK_HOSTS": "j-my-task-0.j,j-my-task-1.j", "VC_MY_TASK_NUM": "2", "VC_TASK_INDEX": "1"}
    r = res(env)
    assert (r.nnodes.value, r.node_rank.value, r.master_addr.value) == (2, 1, "j-my-task-0.j")


def test_volcano_env_plugin_only_gives_the_node_rank():
    r = res({"VK_TASK_INDEX": "1"}, nnodes="2")
    assert r.node_rank.value == 1 and r.node_rank.source == "VK_TASK_INDEX"


VOLCANO_2 = {"VC_MASTER_HOSTS": "pt-master-0.pt", "VC_MASTER_NUM": "1",
             "VC_WORKER_HOSTS": "pt-worker-0.pt,pt-worker-1.pt", "VC_WORKER_NUM": "2", "VC_TASK_INDEX": "1"}


def test_volcano_master_and_worker_tasks_by_host_name():
    r = res(dict(VOLCANO_2, HOSTNAME="pt-worker-1"))
    assert (r.nnodes.value, r.node_rank.value, r.master_addr.value) == (3, 2, "pt-master-0.pt")
    assert r.nnodes.source == "VC_MASTER_NUM + VC_WORKER_NUM"
    assert "pt-worker-1" in r.node_rank.source


def test_volcano_pytorch_plugin_agrees_with_the_host_list():
    env = dict(VOLCANO_2, HOSTNAME="pt-worker-0", MASTER_ADDR="pt-master-0.pt", MASTER_PORT="23456",
               WORLD_SIZE="3", RANK="1")
    r = res(env, nproc_per_node="2")
    assert (r.nnodes.value, r.node_rank.value, r.world_size) == (3, 1, 6)
    assert r.node_rank.source == "RANK (the pod's rank)"
    assert r.master_port.value == 23456 and r.warnings[:-1] == []


def test_volcano_several_tasks_and_unknown_host_name():
    with pytest.raises(ResolveError, match=r"several tasks \(MASTER, WORKER\).*pass --node-rank"):
        res(dict(VOLCANO_2, HOSTNAME="elsewhere"))
    assert res(dict(VOLCANO_2, HOSTNAME="elsewhere"), node_rank="0").node_rank.value == 0


# -- contradictions between environment sources ----------------------------------------------------


def test_env_sources_disagreeing_on_the_node_rank_is_an_error():
    with pytest.raises(ResolveError, match=r"contradicts itself: node rank: PET_NODE_RANK gives 0, "
                                           r"JOB_COMPLETION_INDEX gives 1"):
        res({"PET_NNODES": "2", "PET_NODE_RANK": "0", "JOB_COMPLETION_INDEX": "1"})


def test_env_sources_disagreeing_on_the_master_is_a_warning():
    r = res({"PET_MASTER_ADDR": "a.example", "MASTER_ADDR": "localhost"})
    assert r.master_addr.value == "a.example"
    assert any("PET_MASTER_ADDR gives 'a.example', MASTER_ADDR gives 'localhost'" in w for w in r.warnings)


def test_flag_over_contradicting_environment_is_fine():
    r = res({"PET_NODE_RANK": "0", "JOB_COMPLETION_INDEX": "1", "PET_NNODES": "2"}, node_rank="1")
    assert r.node_rank.value == 1


# -- parsing and errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [("2", 2), ("3:3", 3), (" 4", 4)])
def test_nnodes_forms(text, expected):
    assert res(nnodes=text).nnodes.value == expected


@pytest.mark.parametrize("text, message", [
    ("4:1", "MIN \\(4\\) is larger than MAX \\(1\\)"), ("0", "at least 1"), ("two", "must be an integer"),
    ("1:2:3", "not N or MIN:MAX"), ("0:2", "the minimum number of nodes must be at least 1"),
])
def test_nnodes_errors(text, message):
    with pytest.raises(ResolveError, match=message):
        res(nnodes=text)


@pytest.mark.parametrize("env, flag", [({"PET_NNODES": "1:3"}, None), ({}, "1:3")])
def test_an_elastic_range_gives_min_and_max(env, flag):
    """Kubeflow's elastic PyTorchJob sets PET_NNODES=MIN:MAX; torchrun takes --nnodes MIN:MAX."""
    r = res(env, nnodes=flag) if flag else res(env)
    assert (r.fewest_nodes, r.nnodes.value) == (1, 3)


def test_a_file_endpoint_is_the_rendezvous_file():
    r = res(rdzv_backend="c10d", rdzv_endpoint="file:///shared/job/rdzv")
    assert r.rdzv_file.value == "/shared/job/rdzv" and not r.private_store


@pytest.mark.parametrize("endpoint, backend, words", [
    ("file://shared/x", "c10d", "is not file:///ABSOLUTE/PATH"),
    ("file:///shared/", "c10d", "names a directory"),
    ("file:///shared/x", "static", "it needs --rdzv-backend c10d"),
])
def test_bad_file_endpoints_say_why(endpoint, backend, words):
    with pytest.raises(ResolveError, match=re.escape(words)):
        res(rdzv_backend=backend, rdzv_endpoint=endpoint)


@pytest.mark.parametrize("text, gpus, expected, source_part", [
    ("4", 0, 4, "flag --nproc-per-node"),
    ("cpu", 2, 8, "8 CPU(s)"),
    ("gpu", 2, 2, "2 GPU(s)"),
    ("auto", 2, 2, "2 GPU(s)"),
    ("auto", 0, 8, "8 CPU(s) (no GPU"),
])
def test_nproc_per_node_forms(text, gpus, expected, source_part):
    r = res(gpus=gpus, nproc_per_node=text)
    assert r.nproc_per_node.value == expected and source_part in r.nproc_per_node.source


@pytest.mark.parametrize("text, message", [
    ("gpu", "no GPU found"), ("xpu", "not supported"), ("0", "at least 1"), ("many", "a number, cpu, gpu or auto"),
])
def test_nproc_per_node_errors(text, message):
    with pytest.raises(ResolveError, match=message):
        res(nproc_per_node=text)


def test_gpu_count_reads_cuda_visible_devices():
    from distlib.launcher.resolve import _gpu_count

    assert _gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,3"})[0] == 3
    assert _gpu_count({"CUDA_VISIBLE_DEVICES": ""})[0] == 0
    assert _gpu_count({"CUDA_VISIBLE_DEVICES": "0,-1,2"})[0] == 1


def test_node_rank_out_of_range():
    with pytest.raises(ResolveError, match=r"node rank 2 \(from flag --node-rank\) is out of range for 2 node"):
        res(nnodes="2", node_rank="2")
    with pytest.raises(ResolveError, match="must be at least 0"):
        res(nnodes="2", node_rank="-1")


@pytest.mark.parametrize("text", ["$(JOB_COMPLETION_INDEX)", "${NODE_RANK}", "$NODE_RANK"])
def test_unexpanded_variable_references(text):
    with pytest.raises(ResolveError, match="a variable reference nobody expanded"):
        res(nnodes="2", node_rank=text)


def test_unexpanded_run_id():
    with pytest.raises(ResolveError, match=r"\$\(DISTLIB_RUN_ID\)"):
        res(run_id="$(DISTLIB_RUN_ID)")


def test_node_rank_auto():
    r = res(nnodes="3", node_rank="auto", rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:29500", run_id="x")
    assert r.node_rank_auto and r.node_rank.value is None
    assert res(nnodes="3", node_rank="AUTO", rdzv_backend="c10d", rdzv_endpoint="h").node_rank_auto
    with pytest.raises(ValueError, match="not known yet"):
        worker_env(r, 0)
    assert worker_env(r.with_node_rank(2, "test"), 0)["RANK"] == "2"


def test_node_rank_auto_needs_c10d():
    with pytest.raises(ResolveError, match="--node-rank auto needs --rdzv-backend c10d"):
        res(nnodes="3", node_rank="auto")


def test_node_rank_auto_with_an_init_method_is_an_error():
    with pytest.raises(ResolveError, match="DISTLIB_INIT_METHOD"):
        res({"DISTLIB_INIT_METHOD": "file:///shared/x/store"}, node_rank="auto", rdzv_backend="c10d",
            rdzv_endpoint="h:1")


def test_node_rank_auto_only_as_a_flag():
    with pytest.raises(ResolveError, match="only accepted as a flag"):
        res({"PET_NODE_RANK": "auto"})


# -- backends, endpoints, master ------------------------------------------------------------------


def test_c10d_needs_an_endpoint():
    with pytest.raises(ResolveError, match="--rdzv-backend c10d needs --rdzv-endpoint"):
        res(rdzv_backend="c10d")


@pytest.mark.parametrize("endpoint, host, port", [
    ("store.example:1234", "store.example", 1234),
    ("store.example", "store.example", 29500),
    ("[::1]:1234", "::1", 1234),
    ("[fd00::5]", "fd00::5", 29500),
    ("fd00::5", "fd00::5", 29500),
])
def test_endpoint_forms(endpoint, host, port):
    r = res(rdzv_backend="c10d", rdzv_endpoint=endpoint, run_id="r")
    assert (r.master_addr.value, r.master_port.value) == (host, port)


@pytest.mark.parametrize("endpoint, message", [
    (":1234", "has no host"), ("h:99999", "between 0 and 65535"), ("h:x", "must be an integer"),
    ("[::1", "not \\[IPv6\\]:port"),
])
def test_endpoint_errors(endpoint, message):
    with pytest.raises(ResolveError, match=message):
        res(rdzv_backend="c10d", rdzv_endpoint=endpoint)


def test_c10d_ignores_master_flags_with_a_warning():
    r = res(rdzv_backend="c10d", rdzv_endpoint="s:1", master_addr="m", run_id="r")
    assert r.master_addr.value == "s"
    assert any("--master-addr is only used with --rdzv-backend static" in w for w in r.warnings)


def test_c10d_default_run_id_warns():
    r = res(rdzv_backend="c10d", rdzv_endpoint="s:1")
    assert any("distinct ids" in w for w in r.warnings)
    assert not any("distinct ids" in w for w in res(rdzv_backend="c10d", rdzv_endpoint="s:1", run_id="r").warnings)


def test_static_with_an_endpoint_uses_it_as_the_master():
    r = res(rdzv_endpoint="node0.example:1111")
    assert (r.master_addr.value, r.master_port.value) == ("node0.example", 1111)
    assert r.master_addr.source == "flag --rdzv-endpoint"


def test_static_master_flag_and_endpoint_flag_must_agree():
    with pytest.raises(ResolveError, match="master address: flag --master-addr says 'a' but flag --rdzv-endpoint"):
        res(master_addr="a", rdzv_endpoint="b:1")
    assert res(master_addr="a", rdzv_endpoint="a:1").master_port.value == 1


def test_static_master_addr_brackets_removed():
    assert res(master_addr="[::1]").master_addr.value == "::1"


@pytest.mark.parametrize("port, message", [("0", "cannot work with --rdzv-backend static"),
                                           ("70000", "between 0 and 65535")])
def test_static_port_errors(port, message):
    with pytest.raises(ResolveError, match=message):
        res(master_port=port)


def test_unknown_backend():
    with pytest.raises(ResolveError, match="'etcd-v2' .* is not supported"):
        res(rdzv_backend="etcd-v2")


def test_standalone():
    r = res(standalone=True, nproc_per_node="2")
    assert r.c10d and r.private_store and r.nnodes.value == 1 and r.node_rank.value == 0
    assert (r.master_addr.value, r.master_port.value) == ("127.0.0.1", 0)
    assert not any("distinct ids" in w for w in r.warnings)
    with pytest.raises(ResolveError, match="--standalone runs one node"):
        res(standalone=True, nnodes="2")


# -- run id ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("env, flag, value, source", [
    ({"PET_RDZV_ID": "p", "DISTLIB_RUN_ID": "d", "TORCHELASTIC_RUN_ID": "t"}, "f", "f", "flag --run-id"),
    ({"PET_RDZV_ID": "p", "DISTLIB_RUN_ID": "p", "TORCHELASTIC_RUN_ID": "t"}, None, "p", "PET_RDZV_ID"),
    ({"DISTLIB_RUN_ID": "d", "TORCHELASTIC_RUN_ID": "t"}, None, "d", "DISTLIB_RUN_ID"),
    ({"TORCHELASTIC_RUN_ID": "t"}, None, "t", "TORCHELASTIC_RUN_ID"),
    ({}, None, "none", "default"),
])
def test_run_id_precedence(env, flag, value, source):
    r = res(env, run_id=flag)
    assert (r.run_id.value, r.run_id.source) == (value, source)


def test_run_id_sources_disagreeing_warn():
    r = res({"PET_RDZV_ID": "p", "DISTLIB_RUN_ID": "d"})
    assert r.run_id.value == "p" and any("DISTLIB_RUN_ID gives 'd'" in w for w in r.warnings)


# -- worker environment ---------------------------------------------------------------------------


def test_omp_num_threads():
    assert res(nproc_per_node="2").extra_env["OMP_NUM_THREADS"].value == "1"
    assert res({"OMP_NUM_THREADS": "4"}, nproc_per_node="2").extra_env == {}
    assert res(nproc_per_node="1").extra_env == {}


def test_worker_env_static():
    r = res(nnodes="2", nproc_per_node="3", node_rank="1", master_addr="m", master_port="1234", run_id="r",
            env={"OMP_NUM_THREADS": "2"})
    env = worker_env(r, 2)
    assert env == {
        "RANK": "5", "LOCAL_RANK": "2", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "1",
        "NODE_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "5", "ROLE_WORLD_SIZE": "6", "ROLE_NAME": "default",
        "MASTER_ADDR": "m", "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "r", "DISTLIB_RUN_ID": "r",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False", "DISTLIB_EXTERNAL_STORE": "0",
    }


def test_program_argv():
    assert Program("train.py", ("--x", "1")).argv()[1:] == ["-u", "train.py", "--x", "1"]
    assert Program("pkg.mod", ("a",), module=True, python="py").argv() == ["py", "-u", "-m", "pkg.mod", "a"]
