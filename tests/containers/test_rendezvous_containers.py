"""Cross-container rendezvous: 4 ranks, each in its own container (its own host name, network
namespace and /dev/shm) on a private network, for every init method — then an all_reduce and
an all_gather whose results every rank checks (deploy/distlib_deploy/jobs/check_collectives.py).

Needs a Docker engine (marker ``containers``); the image is built once per session.
"""

from __future__ import annotations

import pytest

from tests.containers._ranks import CHECK, assert_all_ok, logs, start_ranks, wait_exit

pytestmark = pytest.mark.containers

WORLD = 4
TIMEOUT = ["--timeout", "60"]


def check_addresses(matches, containers):
    """Each rank ran in its own container, and advertised that container's address."""
    hosts = {m.group(5) for m in matches.values()}
    assert hosts == {f"node{r}" for r in range(WORLD)}, hosts
    for r, m in matches.items():
        assert m.group(6).rsplit(":", 1)[0] == containers[r].ip, (r, m.group(0))


def test_env_rendezvous_rank0_hosts_the_store(distlib_image, docker_network, container_factory):
    net = docker_network(internal=True)
    ranks = start_ranks(
        container_factory, distlib_image, net, WORLD,
        command=lambda r: CHECK + TIMEOUT,
        env=lambda r: {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "RANK": str(r), "WORLD_SIZE": str(WORLD)})
    check_addresses(assert_all_ok(ranks, WORLD), ranks)


def test_tcp_rendezvous_rank0_hosts_the_store(distlib_image, docker_network, container_factory):
    net = docker_network(internal=True)
    ranks = start_ranks(
        container_factory, distlib_image, net, WORLD,
        command=lambda r: CHECK + TIMEOUT + ["--init-method", f"tcp://node0:29500?rank={r}&world_size={WORLD}"],
        env=lambda r: {})
    check_addresses(assert_all_ok(ranks, WORLD), ranks)


def test_tcp_rendezvous_through_the_master_service(distlib_image, docker_network, container_factory):
    """A dedicated `distlib store-server` container; every rank (rank 0 too) is its client,
    and the job's keys live under its run id."""
    net = docker_network(internal=True)
    master = container_factory(distlib_image, command=["distlib", "store-server", "--host", "0.0.0.0", "--port", "29500"],
                               network=net, aliases=["master"], hostname="master")
    ranks = start_ranks(
        container_factory, distlib_image, net, WORLD,
        command=lambda r: CHECK + TIMEOUT + [
            "--init-method", f"tcp://master:29500?rank={r}&world_size={WORLD}&external_store=1"],
        env=lambda r: {"DISTLIB_RUN_ID": "rdzv-test-1"})
    check_addresses(assert_all_ok(ranks, WORLD), ranks)
    # No rank hosted a store: the keys are in the master service, under the run id.
    code, out = master.get_wrapped_container().exec_run(["python", "-c", (
        "from distlib import TCPStore, PrefixStore\n"
        "s = TCPStore('127.0.0.1', 29500)\n"
        "print('keys', s.num_keys())\n"
        "p = PrefixStore('distlib/run/rdzv-test-1', s)\n"
        "print('run-keys', sum(1 for r in range(4) if p.check(['default_pg/0//cpu//join/%d' % r])))")])
    out = out.decode()
    assert code == 0, out
    assert "run-keys 4" in out, out


def test_file_rendezvous_on_a_shared_volume(distlib_image, docker_network, container_factory, named_volume):
    """FileStore on one named volume mounted by all 4 containers (the substitute, on one
    Docker host, for ReadWriteMany storage); the data still moves over TCP between them."""
    net = docker_network(internal=True)
    volume = named_volume("filestore")
    ranks = start_ranks(
        container_factory, distlib_image, net, WORLD,
        command=lambda r: CHECK + TIMEOUT + [
            "--init-method", f"file:///shared/run1/store?rank={r}&world_size={WORLD}"],
        # an internal network has no default route: name the interface to advertise
        env=lambda r: {"GLOO_SOCKET_IFNAME": "eth0"},
        volumes=[(volume.name, "/shared", "rw")])
    check_addresses(assert_all_ok(ranks, WORLD), ranks)
    # Every rank closed the store cleanly: the file and its liveness side file are gone.
    probe = container_factory(distlib_image, command=["ls", "-A", "/shared/run1"],
                              volumes=[(volume.name, "/shared", "ro")])
    assert wait_exit(probe, 30) == 0
    assert logs(probe).split() == [], logs(probe)
