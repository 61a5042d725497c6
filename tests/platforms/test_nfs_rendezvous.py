"""init_process_group on a FileStore on NFS, across 2 and 3 VM hosts, then a gloo all_reduce
between them over the VMs' LAN (guest/rendezvous.py, one rank per VM)."""

from __future__ import annotations

import pytest

from tests.support.vm_nfs import script, side_by_side

# the first test also waits for the VM image (minutes, once per machine) and the boot
pytestmark = [pytest.mark.vms, pytest.mark.timeout(1800)]

LAN = {"GLOO_SOCKET_IFNAME": "eth1"}  # the VMs' LAN (eth0 is QEMU's user network)
TIMEOUT_S = "120"


def _check_ranks(results, world, where):
    total = sum(range(1, world + 1))
    for rank, got in enumerate(results):
        assert "error" not in got, \
            f"{where}: rank {rank} on {got['vm']} failed: {got['error']}\n{got['stderr'][-2000:]}"
        assert (got["rank"], got["world"]) == (rank, world), \
            f"{where}: {got['vm']} says rank {got['rank']}/{got['world']}"
        assert got["all_reduce"] == [total] * 4, f"{where}: rank {rank} on {got['vm']} got {got['all_reduce']}"
    assert len({got["host"] for got in results}) == world, f"{where}: ranks shared a host: {results}"


@pytest.mark.parametrize("mount, world", [("ganesha-nfs4.1", 2), ("nfs4.2", 3), ("nfs3", 3)])
def test_init_process_group_on_nfs_across_hosts(nfs_hosts, mount, world):
    """init_method="file:///mnt/.../store", rank and world_size given, as torch scripts do."""
    url = f"file://{nfs_hosts.new_dir(mount, 'rdzv')}/store"
    vms = nfs_hosts.clients[:world]
    results = side_by_side(*[
        (lambda vm=vm, rank=rank: script(vm, "rendezvous.py", [TIMEOUT_S, url, str(rank), str(world)], 300, LAN))
        for rank, vm in enumerate(vms)])
    _check_ranks(results, world, f"{world} hosts on {mount}")


def test_an_unmodified_script_rendezvous_through_the_launchers_file_store(nfs_hosts):
    """``init_process_group("gloo")`` with the environment distlib-run gives in the cluster's file
    modes: DISTLIB_INIT_METHOD names the FileStore on NFS, and MASTER_ADDR is the loopback
    (no TCP store anywhere): the script must meet through the FileStore, not dial 127.0.0.1."""
    url = f"file://{nfs_hosts.new_dir('nfs4.2', 'env')}/store"
    world = 2
    vms = nfs_hosts.clients[:world]

    def env(rank):
        return {**LAN, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500", "DISTLIB_INIT_METHOD": url, "TORCHELASTIC_USE_AGENT_STORE": "False",
                "DISTLIB_EXTERNAL_STORE": "0"}

    results = side_by_side(*[(lambda vm=vm, rank=rank: script(vm, "rendezvous.py", ["60"], 200, env(rank)))
                             for rank, vm in enumerate(vms)])
    _check_ranks(results, world, "init_process_group('gloo') with DISTLIB_INIT_METHOD on nfs4.2")
