"""Cross-container rendezvous: 4 ranks, each in its own container (its own host name, network
namespace and /dev/shm) on a private network, for every init method — then an all_reduce and
an all_gather whose results every rank checks (deploy/distlib_deploy/jobs/check_collectives.py).
The containers are hosts of the distlib.testing harness.

Needs a Docker engine (marker ``containers``); the image is built once per session.
"""

from __future__ import annotations

import pytest

from distlib.testing import Job
from tests.containers.check_lines import assert_all_ok, check

pytestmark = pytest.mark.containers

WORLD = 4
#: rank 0 hosts the store itself: the harness's master service is not the job's store
OWN_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "False", "DISTLIB_EXTERNAL_STORE": "0"}


def check_addresses(matches, result):
    """Each rank ran in its own container, and advertised that container's address."""
    assert {m.group(5) for m in matches.values()} == {f"node{r}" for r in range(WORLD)}, matches
    for r, m in matches.items():
        assert m.group(6).rsplit(":", 1)[0] == result.hosts[m.group(5)].address, (r, m.group(0))


def test_env_rendezvous_rank0_hosts_the_store(containers):
    result = containers(WORLD).run(check("--timeout", 60, MASTER_ADDR="node0", **OWN_STORE), deadline=180)
    check_addresses(assert_all_ok(result, WORLD), result)


def test_tcp_rendezvous_rank0_hosts_the_store(containers):
    """tcp://node0:29500 (rank and world size from RANK and WORLD_SIZE)."""
    result = containers(WORLD).run(check("--timeout", 60, "--init-method", "tcp://node0:29500", **OWN_STORE),
                                   deadline=180)
    check_addresses(assert_all_ok(result, WORLD), result)


def test_file_rendezvous_on_a_shared_volume(containers):
    """FileStore on one volume mounted by all 4 containers (the substitute, on one Docker host,
    for ReadWriteMany storage); the data still moves over TCP between them."""
    cluster = containers(WORLD)
    directory = f"{cluster.substrate.shared}/run1"
    result = cluster.run(check("--timeout", 60, "--init-method", f"file://{directory}/store",
                               GLOO_SOCKET_IFNAME="eth0"), deadline=180)  # no default route: name the interface
    check_addresses(assert_all_ok(result, WORLD), result)
    # Every rank closed the store cleanly: the file and its liveness side file are gone.
    listing = cluster.run(Job(["-c", f"import os; print('left:', sorted(os.listdir({directory!r})))"]), deadline=120)
    listing.assert_ok()
    assert all("left: []" in h.output for n, h in listing.hosts.items() if n != "master"), listing.report()
