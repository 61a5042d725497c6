"""Who a process is (distlib/identity.py), where its job's keys are (distlib/keyspace.py), store
chains (distlib/store/chain.py) and the world's fields (distlib/group.py): each read once, in
one place, and nothing written behind the caller's back."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

import distlib
from distlib.group import _World, world
from distlib.identity import Identity, IdentityError
from distlib.keyspace import KeySpace
from distlib.rendezvous import rendezvous
from distlib.store.chain import close_quietly, innermost
from distlib.store.hash import HashStore
from distlib.store.prefix import PrefixStore
from tests.fixtures.ports import free_port

pytestmark = pytest.mark.timeout(60)

#: An srun task: rank 3 of 4 on the second of two nodes (block distribution), nothing of torch's set.
TASK3 = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
         "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
         "SLURM_STEP_NODELIST": "node[1-2]"}
TORCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_RUN_ID", "DISTLIB_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
         "TORCHELASTIC_USE_AGENT_STORE", "DISTLIB_EXTERNAL_STORE", "DISTLIB_INIT_METHOD", "USE_LIBUV")


@pytest.fixture(autouse=True)
def no_job_variables(monkeypatch):
    for name in TORCH + tuple(TASK3):
        monkeypatch.delenv(name, raising=False)


# -- the identity -------------------------------------------------------------------------------------


def test_torchs_variables_as_a_value_with_their_sources():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job",
           "TORCHELASTIC_RESTART_COUNT": "2"}
    me = Identity.read(env)
    assert (me.rank, me.world_size, me.local_rank, me.local_world_size, me.node_rank, me.nnodes) == (5, 8, 1, 4, 1, 2)
    assert (me.master_addr, me.master_port, me.run_id, me.restart_count) == ("node1", 29500, "job", 2)
    assert me.source("rank") == "RANK=5, from the environment"
    assert me.keys == KeySpace("job", 2)


def test_arguments_come_first():
    me = Identity.read({"RANK": "5", "WORLD_SIZE": "8"}, rank=1, world_size=2)
    assert (me.rank, me.world_size) == (1, 2)
    assert me.source("world_size") == "world_size=2, from the world_size= argument"


def test_slurm_stands_in_for_what_the_environment_lacks():
    me = Identity.read(dict(TASK3, MASTER_PORT="29600"))
    assert (me.rank, me.world_size, me.local_rank, me.local_world_size, me.node_rank, me.nnodes) == (3, 4, 1, 2, 1, 2)
    assert (me.master_addr, me.master_port, me.run_id) == ("node1", 29600, "slurm-4242.0")
    assert me.source("rank") == "RANK=3, from SLURM_PROCID=3 (srun)"
    assert me.source("master_port") == "MASTER_PORT=29600, from the environment"


def test_a_rank_given_keeps_slurms_local_values_out():
    me = Identity.read(TASK3, rank=0)
    assert me.rank == 0 and me.local_rank is None and me.node_rank is None and me.run_id == ""


def test_an_unusable_value_is_raised_only_when_needed():
    me = Identity.read({"RANK": "x", "WORLD_SIZE": "2"})
    assert me.world_size == 2
    with pytest.raises(IdentityError, match=r"^RANK='x' is not an integer$"):
        me.need("rank")
    with pytest.raises(IdentityError, match=r"^environment variable MASTER_ADDR expected, but not set$"):
        me.need("master_addr")


def test_reading_changes_nothing():
    env = dict(TASK3)
    Identity.read(env)
    assert env == TASK3


def test_environ_is_what_read_reads_back():
    """The launcher writes a worker's identity (Identity.environ) with the names env:// reads."""
    me = Identity(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, nnodes=2, master_addr="n1",
                  master_port=29500, run_id="job", restart_count=2, max_restarts=3, role="trainer",
                  external_store=True)
    env = me.environ()
    assert env["NODE_RANK"] == "1" and env["ROLE_RANK"] == "5" and env["DISTLIB_RUN_ID"] == "job"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["DISTLIB_EXTERNAL_STORE"] == "1"
    assert Identity.read(env) == me


def test_env_init_inside_slurm_writes_no_environ(monkeypatch):
    """env:// in an srun task (rank 0 of 1): the rendezvous works from Slurm's variables, and
    os.environ has none of torch's variables afterwards: code that needs them asks distlib."""
    port = free_port()
    for name, value in {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                        "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_LOCALID": "0",
                        "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_STEP_NODELIST": "localhost",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    store, rank, world_size = next(rendezvous("env://", timeout=timedelta(seconds=10)))
    try:
        assert (rank, world_size) == (0, 1)
        changed = {k: (before.get(k), v) for k, v in os.environ.items() if before.get(k) != v}
        assert changed == {}, f"env:// wrote into os.environ: {changed}"
        assert distlib.get_node_local_rank() == 0
    finally:
        store.close()


def test_get_node_local_rank_is_torchs(monkeypatch):
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not in the environment. Consider passing fallback_rank"):
        distlib.get_node_local_rank()
    assert distlib.get_node_local_rank(fallback_rank=3) == 3
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert distlib.get_node_local_rank(fallback_rank=3) == 2
    monkeypatch.setenv("LOCAL_RANK", "two")
    with pytest.raises(ValueError, match="LOCAL_RANK='two' is not an integer"):
        distlib.get_node_local_rank(fallback_rank=3)


# -- rank's type (issue 37) ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["store", "init_method"])
def test_a_rank_of_the_wrong_type_gets_torchs_message(how):
    """init_process_group(rank="0") used to fail with "'>=' not supported between 'str' and
    'int'"; torch checks rank's type as it checks world_size's."""
    where = {"store": HashStore()} if how == "store" else {"init_method": f"tcp://127.0.0.1:{free_port()}"}
    with pytest.raises(RuntimeError, match=r"^`rank` must be an integer. 0$"):
        distlib.init_process_group("gloo", rank="0", world_size=1, **where)
    with pytest.raises(RuntimeError, match=r"^`world_size` must be an integer. 1$"):
        distlib.init_process_group("gloo", rank=0, world_size="1", **where)
    assert not distlib.is_initialized()


# -- the key space ----------------------------------------------------------------------------------------


def test_every_name_of_a_run_and_attempt():
    keys = KeySpace("job-1", 2)
    assert keys.store_prefix() == "distlib/run/job-1/attempt_2"
    assert keys.of_attempt(0).store_prefix() == "distlib/run/job-1"
    assert KeySpace("", 0).store_prefix() == ""
    assert keys.node_rank_counter() == "distlib/run/job-1/node_rank"
    assert keys.elastic_state() == "distlib/elastic/job-1/state"
    assert keys.heartbeat("n1") == "distlib/elastic/job-1/hb/n1"
    assert keys.file_store("/shared/rdzv") == "/shared/rdzv.job-1.attempt_2"


def test_the_rendezvous_and_the_launcher_use_the_same_names():
    """The worker's store prefix (rendezvous), a round's file store (elastic agent) and the
    dry-run report's come from one KeySpace: a round's keys never meet the round before's."""
    from distlib.launcher.master import node_rank_key

    assert node_rank_key("job-1") == KeySpace("job-1").node_rank_counter()
    assert Identity.read({"TORCHELASTIC_RUN_ID": "job-1", "TORCHELASTIC_RESTART_COUNT": "3"}).keys.store_prefix() \
        == "distlib/run/job-1/attempt_3"


# -- store chains -------------------------------------------------------------------------------------------


class Closing(HashStore):
    def __init__(self, fails: bool = False):
        super().__init__()
        self.closed = 0
        self.fails = fails

    def close(self) -> None:
        self.closed += 1
        if self.fails:
            raise OSError("the file system went away")


def test_innermost_follows_every_wrapper():
    base = Closing()
    chain = PrefixStore("a/", PrefixStore("b/", base))
    assert innermost(chain) is base and innermost(base) is base


def test_close_quietly_closes_the_end_of_the_chain_and_swallows_its_failure():
    base, failing = Closing(), Closing(fails=True)
    close_quietly(PrefixStore("a/", PrefixStore("b/", base)))
    close_quietly(PrefixStore("a/", failing))
    close_quietly(None)
    close_quietly(HashStore())  # nothing to close: nothing happens
    assert base.closed == 1 and failing.closed == 1


# -- the world's fields ----------------------------------------------------------------------------------


def test_reset_puts_back_every_declared_field():
    """Every field of the world is declared on _World, and reset covers each (owns_store was
    added at init and never reset)."""
    declared = set(_World.__annotations__)
    fresh = _World()
    assert declared <= set(vars(fresh)), f"declared but not set by reset: {declared - set(vars(fresh))}"
    assert set(vars(fresh)) - {"lock"} == declared, f"set but not declared: {set(vars(fresh)) - declared - {'lock'}}"


def test_destroy_leaves_the_world_as_new(monkeypatch):
    port = free_port()
    distlib.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                               timeout=timedelta(seconds=20))
    assert world.owns_store and world.identity is not None and world.identity.rank == 0
    distlib.destroy_process_group()
    fresh = _World()
    for name in _World.__annotations__:
        assert getattr(world, name) == getattr(fresh, name), f"world.{name} after destroy: {getattr(world, name)!r}"
