"""Slurm's variables, read for torch's names (distlib/slurm) and by the launcher's resolver.

Pure tests on env dicts: the host list syntax and its malformed forms, the tasks-per-node
forms, what a step's task is told, the consistency errors, the port rule, and where the
Slurm convention stands against torchrun's and the other variables. The real cluster's
`scontrol show hostnames` and srun's real variables are checked in
tests/containers/test_slurm_cluster.py.
"""

from __future__ import annotations

import pytest

from distlib.launcher.resolve import Flags, Probe, ResolveError, resolve
from distlib.launcher.workerenv import worker_env
from distlib.slurm import hostlist
from distlib.slurm.step import SlurmError, Step, outside_step_hint, parse_tasks_per_node, port_for, torch_environment

# -- host lists -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[1-3,5,7-8]", ["node1", "node2", "node3", "node5", "node7", "node8"]),
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("node[1-010]", [f"node{i}" for i in range(1, 11)]),          # the width is LO's as written
    ("node[001-3]", ["node001", "node002", "node003"]),
    ("node[9-10],gpu[1-2]", ["node9", "node10", "gpu1", "gpu2"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("gpu-[1-2],a-b[7]", ["gpu-1", "gpu-2", "a-b7"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),     # two groups: the first slowest
    ("n[1-2]-[3-4]", ["n1-3", "n1-4", "n2-3", "n2-4"]),
    # three and more: the last fastest, then the first, ..., the next-to-last slowest (Slurm's order)
    ("x[1-2]y[3-4]z[5-6]", ["x1y3z5", "x1y3z6", "x2y3z5", "x2y3z6", "x1y4z5", "x1y4z6", "x2y4z5", "x2y4z6"]),
    ("a[1-2]b[3-5]c[6-7]", ["a1b3c6", "a1b3c7", "a2b3c6", "a2b3c7", "a1b4c6", "a1b4c7", "a2b4c6", "a2b4c7",
                            "a1b5c6", "a1b5c7", "a2b5c6", "a2b5c7"]),
    ("[1-2]", ["1", "2"]),
    ("node2,node1,node2", ["node2", "node1", "node2"]),           # order and duplicates as written
    ("node1 node2\tnode3", ["node1", "node2", "node3"]),
    ("node[1-2],", ["node1", "node2"]),
    ("", []),
    ("my-cluster.example.org", ["my-cluster.example.org"]),
])
def test_hostlist_forms(text, hosts):
    assert hostlist.expand(text) == hosts


def test_hostlist_large_range_keeps_width():
    hosts = hostlist.expand("n[0000-1023]")
    assert len(hosts) == 1024 and hosts[0] == "n0000" and hosts[-1] == "n1023"


@pytest.mark.parametrize("text, words", [
    ("node[1-3", "a '[' that is never closed"),
    ("node1-3]", "a ']' without its '[' at position 7"),
    ("node[]", "an empty range in the host list 'node[]'"),
    ("node[1,,2]", "an empty range"),
    ("node[3-1]", "the range '3-1' in the host list 'node[3-1]' runs backwards (3 > 1)"),
    ("node[a-b]", "the range 'a-b' in the host list 'node[a-b]' is not N or LO-HI"),
    ("node[1-2-3]", "'1-2-3'"),
    ("node[-1]", "'-1'"),
    ("node[[1-2]]", "a '[' inside brackets at position 5: bracket groups cannot be nested"),
    ("node[1-70000]", "names 70000 hosts, more than Slurm's limit of 65536"),
    ("a[1-2000]b[1-2000]", "names 4000000 hosts"),
    ("x,node[1 -2]", "white space inside brackets"),
    ("b[2-3]-ib", "'b[2-3]-ib' in the host list 'b[2-3]-ib' has '-ib' after its last ']'"),
    ("a,r[1-2]n[3]x", "has 'x' after its last ']'"),
])
def test_malformed_hostlists_say_where(text, words):
    with pytest.raises(hostlist.HostlistError) as info:
        hostlist.expand(text)
    assert words in str(info.value)
    assert repr(text) in str(info.value) or "'node" in str(info.value)


# -- tasks per node -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, counts", [
    ("4", [4]),
    ("2(x2)", [2, 2]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("1,3(x2),2", [1, 3, 3, 2]),
    ("8(x1)", [8]),
])
def test_tasks_per_node_forms(text, counts):
    assert parse_tasks_per_node(text, "SLURM_STEP_TASKS_PER_NODE") == counts


@pytest.mark.parametrize("text", ["2(x)", "(x3)", "2x3", "2(x0)", "-1", "2(x3),,1", "two"])
def test_malformed_tasks_per_node(text):
    with pytest.raises(SlurmError, match=r"SLURM_STEP_TASKS_PER_NODE=.* is not N or N\(xM\)|repeats a count 0"):
        parse_tasks_per_node(text, "SLURM_STEP_TASKS_PER_NODE")


# -- a step's task --------------------------------------------------------------------------------

#: What `srun -N2 -n4` gives task 3 (as the real cluster does: tests/containers/test_slurm_cluster.py).
TASK3 = {
    "SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURMD_NODENAME": "node2",
}


def test_what_srun_tells_a_task_in_torchs_names():
    got = torch_environment(TASK3)
    assert {k: v for k, (v, _source) in got.items()} == {
        "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "node1", "MASTER_PORT": str(port_for(1234, 0)),
        "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "slurm-1234.0"}
    assert got["RANK"][1] == "SLURM_PROCID=3"
    assert got["MASTER_ADDR"][1] == "the first host of SLURM_STEP_NODELIST=node[1-2]"
    assert got["LOCAL_WORLD_SIZE"][1] == "SLURM_STEP_TASKS_PER_NODE=2(x2) at SLURM_NODEID=1"


def test_uneven_tasks_per_node():
    env = dict(TASK3, SLURM_NTASKS="7", SLURM_NNODES="4", SLURM_STEP_TASKS_PER_NODE="2(x3),1", SLURM_NODEID="3",
               SLURM_PROCID="6", SLURM_LOCALID="0", SLURM_STEP_NODELIST="n[01-04]")
    step = Step(env)
    assert step.tasks_per_node.get() == [2, 2, 2, 1]
    assert (step.local_world_size.get(), step.local_rank.get(), step.node_rank.get()) == (1, 0, 3)
    assert step.master_addr.get() == "n01"


def test_ntasks_per_node_when_the_step_list_is_missing():
    env = {k: v for k, v in TASK3.items() if "TASKS_PER_NODE" not in k}
    env["SLURM_NTASKS_PER_NODE"] = "2"
    assert Step(env).local_world_size.get() == 2


def test_the_port_rule():
    assert port_for(1234, 0) == 22340
    assert port_for(1234, 1) == 22341                     # the next step of the same job
    assert port_for(1235, 0) == 22350                     # the next job
    assert port_for(2234, 0) == port_for(1234, 0)         # 1000 jobs later: the same port again
    ports = {port_for(job, step) for job in range(5000) for step in (0, 1, 4294967294)}
    assert min(ports) == 20000 and max(ports) <= 29999 < 32768


def test_the_run_id_names_job_and_step():
    assert Step(TASK3).run_id.get() == "slurm-1234.0"


@pytest.mark.parametrize("change, words", [
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
    ({"SLURM_PROCID": "-1"}, "SLURM_PROCID='-1' is not an integer"),
    ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' is not an integer of at least 1"),
    ({"SLURM_STEP_NODELIST": "node1"}, "SLURM_STEP_NODELIST=node1 names 1 host(s), fewer than SLURM_NNODES=2"),
    ({"SLURM_STEP_NODELIST": "node[1-3]"}, "SLURM_STEP_NODELIST=node[1-3] names 3 hosts, but SLURM_NNODES=2"),
    ({"SLURM_STEP_NODELIST": "node[1-2"}, "SLURM_STEP_NODELIST: the host list 'node[1-2' has a '['"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, "SLURM_STEP_TASKS_PER_NODE=2(x3) gives the tasks of 3 node(s), "
                                             "but SLURM_NNODES=2"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,2"}, "SLURM_STEP_TASKS_PER_NODE=3,2 adds up to 5 task(s), but SLURM_NTASKS=4"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 is not below the 2 task(s) of this node"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not below SLURM_NNODES=2"),
    ({"SLURM_JOB_ID": "12x"}, "SLURM_JOB_ID='12x' is not an integer"),
])
def test_contradicting_variables_are_errors_that_name_them(change, words):
    with pytest.raises(SlurmError) as info:
        torch_environment(dict(TASK3, **change))
    assert words in str(info.value)


def test_job_nodelist_is_the_fallback_and_may_be_longer():
    env = {k: v for k, v in TASK3.items() if k != "SLURM_STEP_NODELIST"}
    env["SLURM_JOB_NODELIST"] = "node[1-3]"
    assert Step(env).master_addr.get() == "node1"
    assert Step(env).master_addr.source == "the first host of SLURM_JOB_NODELIST=node[1-3]"


def test_torchs_variables_win_one_by_one():
    env = dict(TASK3, MASTER_PORT="12345", MASTER_ADDR="login1")
    got = torch_environment(env)
    assert "MASTER_PORT" not in got and "MASTER_ADDR" not in got
    assert got["RANK"] == ("3", "SLURM_PROCID=3")


def test_a_task_started_by_a_launcher_takes_nothing_from_slurm():
    """A distlib-run (or torchrun) worker inside srun: RANK and the rest are the launcher's,
    even when Slurm's own variables (the launcher's task) contradict them."""
    env = dict(TASK3, SLURM_PROCID="9", RANK="5", WORLD_SIZE="8", MASTER_ADDR="node1", MASTER_PORT="29500",
               LOCAL_RANK="1")
    assert torch_environment(env) == {}


def test_the_jobs_own_run_id_wins():
    assert "TORCHELASTIC_RUN_ID" not in torch_environment(dict(TASK3, DISTLIB_RUN_ID="exp-1"))
    assert "TORCHELASTIC_RUN_ID" not in torch_environment(dict(TASK3, TORCHELASTIC_RUN_ID="exp-2"))


def test_local_variables_only_with_a_rank_from_slurm():
    got = torch_environment(dict(TASK3, RANK="3"))
    assert set(got) == {"WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    assert set(torch_environment(TASK3, given=["RANK"])) == {"WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def test_a_batch_script_is_no_step():
    batch = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2"}
    assert torch_environment(batch) == {}
    assert "SLURM_JOB_ID=77 is set but this is no srun step" in outside_step_hint(batch)
    assert outside_step_hint(TASK3) == "" and outside_step_hint({}) == ""


def test_a_variable_env_needs_that_slurm_lacks_too():
    env = {k: v for k, v in TASK3.items() if "NODELIST" not in k}
    with pytest.raises(SlurmError, match="MASTER_ADDR is not set and SLURM_STEP_NODELIST is not set either"):
        torch_environment(env)


# -- the launcher's convention ---------------------------------------------------------------------


def probe() -> Probe:
    return Probe(cpu_count=lambda: 8, gpu_count=lambda env: (0, "no GPU"), hostname=lambda: "node2")


def res(env, **flags):
    return resolve(Flags(**flags), env, probe())


#: `srun -N2 --ntasks-per-node=1 distlib-run ...`: the launcher of node 1.
LAUNCHER1 = dict(TASK3, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_NPROCS="2", SLURM_LOCALID="0", SLURM_NODEID="1",
                 SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_TASKS_PER_NODE="1(x2)", SLURM_NTASKS_PER_NODE="1")


def test_one_launcher_per_node():
    r = res(LAUNCHER1, nproc_per_node="2")
    assert (r.nnodes.value, r.node_rank.value, r.world_size) == (2, 1, 4)
    assert r.nnodes.source == "SLURM_NNODES=2 (one distlib-run per node)"
    assert r.node_rank.source == "SLURM_NODEID=1"
    assert (r.master_addr.value, r.master_port.value, r.run_id.value) == ("node1", 22340, "slurm-1234.0")
    assert r.master_addr.source == "the first host of SLURM_STEP_NODELIST=node[1-2]"
    assert r.master_port.source.startswith("SLURM_JOB_ID=1234, SLURM_STEP_ID=0 (20000 + 10 x")
    assert r.warnings == [w for w in r.warnings if "OMP_NUM_THREADS" in w]
    env = worker_env(r, local_rank=1)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("3", "1", "4", "node1")


def test_several_launchers_on_a_node_is_an_error_that_says_what_to_run():
    with pytest.raises(ResolveError) as info:
        res(TASK3, nproc_per_node="2")
    text = str(info.value)
    assert "runs several tasks on a node (SLURM_STEP_TASKS_PER_NODE=2(x2))" in text
    assert "srun --ntasks-per-node=1 distlib-run" in text and "srun python train.py" in text


def test_flags_take_over_from_slurms_shape():
    r = res(TASK3, nnodes="4", node_rank="3")
    assert (r.nnodes.value, r.node_rank.value) == (4, 3)
    assert r.master_addr.value == "node1"


def test_slurm_errors_stop_the_launcher_before_it_starts():
    with pytest.raises(ResolveError, match=r"SLURM_NODEID=2 is not below SLURM_NNODES=2: node indices go from 0 to 1 \(Slurm.s variables"):
        res(dict(LAUNCHER1, SLURM_NODEID="2"))
    with pytest.raises(ResolveError, match=r"SLURM_STEP_NODELIST: the host list 'node\[1-' has a '\['"):
        res(dict(LAUNCHER1, SLURM_STEP_NODELIST="node[1-"))


def test_torchruns_pet_variables_come_first():
    r = res(dict(LAUNCHER1, PET_NNODES="2", PET_NODE_RANK="1", PET_MASTER_ADDR="head", PET_MASTER_PORT="29400"))
    assert (r.nnodes.source, r.node_rank.source) == ("PET_NNODES", "PET_NODE_RANK")
    assert (r.master_addr.value, r.master_port.value) == ("head", 29400)
    assert any("master address: PET_MASTER_ADDR gives 'head', the first host of SLURM_STEP_NODELIST=node[1-2] "
               "gives 'node1'" in w for w in r.warnings), r.warnings


def test_torchrun_and_slurm_disagreeing_on_the_nodes_is_an_error():
    with pytest.raises(ResolveError, match=r"the environment contradicts itself: nnodes: PET_NNODES gives 3, "
                                           r"SLURM_NNODES=2 \(one distlib-run per node\) gives 2"):
        res(dict(LAUNCHER1, PET_NNODES="3"))


def test_master_variables_and_run_ids_set_by_hand_win():
    r = res(dict(LAUNCHER1, MASTER_PORT="31000", DISTLIB_RUN_ID="exp-3"))
    assert (r.master_port.value, r.master_port.source) == (31000, "MASTER_PORT")
    assert (r.run_id.value, r.run_id.source) == ("exp-3", "DISTLIB_RUN_ID")
    assert r.master_addr.value == "node1"


def test_flags_win_with_a_note():
    r = res(LAUNCHER1, master_port="29600")
    assert r.master_port.value == 29600
    assert any("SLURM_JOB_ID=1234" in n and "the flag wins" in n for n in r.notes), r.notes


def test_distlib_run_in_a_batch_script_reads_no_slurm_and_notes_why():
    r = res({"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]"})
    assert (r.nnodes.value, r.master_addr.value) == (1, "127.0.0.1")
    assert any("Slurm's variables not read (SLURM_JOB_ID=77 is set but this is no srun step" in n for n in r.notes)
