"""Every fault on both substrates: processes in namespaces (each host its own network stack,
name and address) and containers.

Every test runs tests/testing/jobs/steps.py (init, all_reduces, one line) on 2-3 hosts through
the plugin's ``distlib_cluster`` fixture (by way of ``hosts``, tests/testing/conftest.py) and
checks what a user would: the record of each rank.
"""

import os
import subprocess

import pytest

from distlib.testing import Job, cues, faults

pytestmark = pytest.mark.distlib_substrates("processes", "containers")

STEPS = "tests/testing/jobs/steps.py"


def job(**env):
    return Job.script(STEPS, env={k: str(v) for k, v in env.items()})


def test_a_clean_run_on_three_hosts_each_with_its_own_name_and_address(hosts):
    cluster = hosts(nodes=3)
    result = cluster.run(job(STEPS=10), deadline=120)
    result.assert_ok(world_size=3)
    for r in range(3):
        line = [x for x in result.ranks[r].output if x.startswith("steps:")]
        assert line == [f"steps: rank {r}/3 ok host=node{r} sum=30"], (r, result.ranks[r].output[-5:])
        assert result.ranks[r].last_collective == (10, "all_reduce"), result.ranks[r].summary()
    addresses = {result.hosts[f"node{r}"].address for r in range(3)} | {result.hosts["master"].address}
    assert len(addresses) == 4, addresses


def test_a_host_killed_at_its_collective_k_stops_exactly_there_and_the_survivors_name_it(hosts):
    cluster = hosts(nodes=3)
    result = cluster.run(job(STEPS=500, GROUP_TIMEOUT=30), [(cues.Collective(2, 5), faults.KillNode(2))],
                         deadline=120)
    # held at its 5th collective until the kill: it never got past it, in any run
    assert result.ranks[2].last_collective == (5, "all_reduce"), result.report()
    assert result.ranks[2].signal == 9, result.ranks[2].summary()
    result.assert_survivors_raised("DistBackendError", naming=2, victims=[2])


def test_a_partition_ends_in_a_timeout_that_names_the_silent_rank(hosts):
    cluster = hosts(nodes=3)
    result = cluster.run(job(STEPS=2000, GROUP_TIMEOUT=5),
                         [(cues.Collective(1, 7), faults.Partition([0, 1], [2]))], deadline=120)
    result.assert_survivors_raised("DistBackendError", naming="rank 2 (", victims=[2])
    for r in (0, 1):
        assert "timed out after 5.0s" in result.ranks[r].exception_text, result.ranks[r].summary()
    # and the cut-off rank names someone on the other side
    assert result.ranks[2].exception_type == "DistBackendError", result.ranks[2].summary()


def test_a_paused_host_past_the_deadline_gives_every_stack_and_leaves_nothing_behind(hosts):
    cluster = hosts(nodes=3)
    result = cluster.run(job(STEPS=100000, GROUP_TIMEOUT=600), [(cues.Collective(2, 3), faults.Pause(2))],
                         deadline=8)
    assert result.hang, result.report()
    assert "passed its deadline of 8 s" in result.hang
    assert "rank 2: last entered collective #3 (all_reduce)" in result.hang, result.hang
    for r in range(3):
        assert f"(rank {r}):" in result.hang and "steps.py" in result.hang, result.hang
    with pytest.raises(AssertionError, match="hit its deadline"):
        result.assert_no_hang()
    assert_nothing_left(cluster)


def assert_nothing_left(cluster):
    """After close: no namespace, mount, container, network or volume of the cluster remains."""
    sub = cluster.substrate
    if sub.kind == "processes":
        prefix = sub.fabric.prefix
        cluster.close()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert prefix not in listed, listed
        assert sub.shared not in open("/proc/mounts").read()
        return
    client, prefix = sub.client, sub.prefix
    api_client = __import__("docker").from_env()
    cluster.close()
    left = [c.name for c in api_client.containers.list(all=True) if c.name.startswith(prefix)]
    left += [n.name for n in api_client.networks.list() if n.name.startswith(prefix)]
    left += [v.name for v in api_client.volumes.list() if v.name.startswith(prefix)]
    api_client.close()
    assert left == [], left
    assert client is not None


def test_a_master_restarted_under_keep_master_state_comes_back_with_every_key_it_was_given(hosts):
    """run(..., keep_master_state=True): the harness's master journals to the run's
    master-state directory (store-server --state-dir), and RestartMaster brings it back with its
    keys. Every key the master was told to write before the restart (set, add, compare_set,
    ..., as its observer heard them) and never to delete is in that directory after the run."""
    from distlib.store.tcp.client import TCPStore
    from distlib.store.tcp.security import StoreSecurity
    from distlib.store.tcp.server import StoreServer

    cluster = hosts(nodes=2)
    result = cluster.run(job(STEPS=20), [(cues.Collective(rank=0, n=5), faults.RestartMaster())], deadline=120,
                         keep_master_state=True)
    result.assert_no_hang()
    restarted = result.fault_time(0)
    stores = [e for e in result.events if e.kind == "store"]
    deleted = {k for e in stores if e.data["op"] in ("delete_key", "queue_pop") for k in e.data["keys"]}
    written = {k for e in stores if e.t < restarted and e.data["op"] in ("set", "add", "compare_set", "append",
                                                                           "multi_set")
               for k in e.data["keys"] if not k.startswith("\0")} - deleted
    assert written, f"the master heard no write before its restart:\n{result.report()}"
    state_dir = os.path.join(result.run_dir, "master-state")
    server = StoreServer("127.0.0.1", 0, security=StoreSecurity(), state_dir=state_dir).start()
    try:
        client = TCPStore("127.0.0.1", server.port, timeout=10, security=StoreSecurity())
        # keys as on the wire: the client puts "/" in front of the ones it is given
        missing = [k for k in sorted(written) if not client.check([k[1:] if k.startswith("/") else k])]
        client.close()
    finally:
        server.stop()
    assert not missing, f"keys written before the restart and absent from {state_dir}: {missing}"


def test_a_master_whose_name_resolves_only_later_is_waited_for(hosts):
    cluster = hosts(nodes=3)
    result = cluster.run(job(STEPS=3), [(cues.After(0), faults.Unresolvable("master")),
                                        (cues.After(3), faults.Resolvable("master"))], deadline=120)
    result.assert_ok(world_size=3)
    # each rank connected only after the name came back
    assert len(result.faults) == 2, result.report()
    back = result.fault_time(1)
    firsts = [min(e.t for e in result.events if e.kind == "collective" and e.rank == r) for r in range(3)]
    assert all(t > back for t in firsts), (back, firsts)


def test_a_master_that_never_resolves_is_named_by_every_rank(hosts):
    cluster = hosts(nodes=2)
    result = cluster.run(job(STEPS=3, GROUP_TIMEOUT=6), [(cues.After(0), faults.Unresolvable("master"))],
                         deadline=120)
    for r in range(2):
        rec = result.ranks[r]
        assert rec.exception_type in ("DistNetworkError", "DistStoreError"), rec.summary()
        assert "master" in rec.exception_text, rec.summary()


@pytest.mark.parametrize("state, errno_name", [("full", "No space left"), ("readonly", "Read-only file system")])
def test_a_filestore_on_a_full_or_read_only_directory_fails_naming_the_file(hosts, state, errno_name):
    cluster = hosts(nodes=2)
    store = os.path.join(cluster.substrate.shared, "store")
    result = cluster.run(job(STEPS=3, GROUP_TIMEOUT=10, INIT_METHOD=f"file://{store}"),
                         [(cues.After(0), faults.Disk(state))], deadline=120)
    for r in range(2):
        rec = result.ranks[r]
        assert rec.exception_type is not None, rec.summary()
        assert store in rec.exception_text and errno_name in rec.exception_text, rec.summary()


def square_of_rank_sum():
    import distlib as dist
    import numpy as np

    dist.init_process_group("gloo")
    value = np.array([dist.get_rank()], dtype=np.int64)
    dist.all_reduce(value)
    dist.destroy_process_group()
    return int(value[0]) ** 2


def test_a_function_runs_on_every_rank_and_returns_its_value(hosts):
    result = hosts(nodes=3).run(Job.function(square_of_rank_sum), deadline=120)
    result.assert_ok(world_size=3)
    assert {r: rec.value for r, rec in result.ranks.items()} == {0: 9, 1: 9, 2: 9}
