"""What held a job CLUSTER_TIMEOUT stopped (deploy/distlib_deploy/cluster/stall.py), from logs shaped as
the containers write them (no engine: the end-to-end run is in tests/containers/
test_compose_cluster.py)."""

from __future__ import annotations

from distlib_deploy.cluster.stall import container_of_ranks, held_by, last_word, latest_waits

LAUNCH = ("{t} INFO distlib.launcher: node {n} of 4: starting 1 worker(s), global ranks {n}..{n} of 4; init method "
          "env://; run id 'r1'\n")
# the file-mode hang of issue 27: rank 0 hosts a TCP store in its own container, the others
# dial 127.0.0.1:29500 in theirs
RANK0 = (LAUNCH.format(t="08:00:00", n=0)
         + "".join(f"[rank0] WARNING distlib.join: pg0/gloo rank 0: 1/4 ranks joined after {s}.0s; waiting for "
                   f"ranks 1, 2, 3 (timeout 30m00s)\n" for s in (5, 10, 15)))
OTHER = (LAUNCH + "[rank{n}] WARNING distlib.store.tcp.connect: cannot reach TCPStore server 127.0.0.1:29500 after "
         "15.0s: connection refused (nobody listening) at 127.0.0.1:29500 (this container's own loopback: is "
         "MASTER_ADDR right?); retrying until the deadline (29m45s left)\n")
LOGS = {"worker-1": RANK0, **{f"worker-{n + 1}": OTHER.format(t="08:00:01", n=n) for n in (1, 2, 3)}}


def test_the_ranks_that_never_joined_and_the_one_still_waiting_are_named():
    lines = held_by(LOGS)
    assert lines[0] == "ranks 1, 2, 3 never joined: 1/4 ranks joined, and rank 0 waited for the rest"
    assert lines[1] == ("rank 0 (worker-1) was still waiting: [rank0] WARNING distlib.join: pg0/gloo rank 0: 1/4 "
                        "ranks joined after 15.0s; waiting for ranks 1, 2, 3 (timeout 30m00s)")
    for n, line in zip((1, 2, 3), lines[2:], strict=False):
        assert line.startswith(f"rank {n} (worker-{n + 1}) last said: [rank{n}] WARNING distlib.store.tcp.connect: "
                               "cannot reach TCPStore server 127.0.0.1:29500"), line
        assert "this container's own loopback: is MASTER_ADDR right?" in line
    assert len(lines) == 5


def test_a_rank_whose_container_never_started_its_launcher():
    logs = {"worker-1": RANK0.replace("1/4", "3/4").replace("ranks 1, 2, 3", "ranks 3"),
            "worker-2": LAUNCH.format(t="t", n=1), "worker-3": LAUNCH.format(t="t", n=2),
            "worker-4": "compose_node: 3/4 workers resolve as 'worker'; waiting for the rest\n"}
    lines = held_by(logs)
    assert lines[0] == "rank 3 never joined: 3/4 ranks joined, and rank 0 waited for the rest"
    assert lines[-1] == "rank 3: no container's log says it ran them (see make cluster-logs)"


def test_without_a_wait_every_container_last_words_are_quoted():
    lines = held_by({"worker-1": "stuck: sleeping\n", "worker-2": "step 1\nERROR something: it broke\nstep 2\n"})
    assert lines[0].startswith("no rank logged a wait for the others")
    assert lines[1:] == ["worker-1 last said: stuck: sleeping", "worker-2 last said: ERROR something: it broke"]


def test_the_container_of_a_rank_from_compose_nodes_lines_and_the_ranks_own():
    logs = {"worker-2": "compose_node: mode file: node rank 0 of 2 (address 172.18.0.3 among ...); FileStore x\n"
                        "compose_node: exec distlib-run --nnodes 2 --nproc-per-node 2 --run-id r --node-rank 0 x.py\n",
            "worker-1": "compose_node: mode file: node rank 1 of 2 (address 172.18.0.4 among ...)\n"
                        "compose_node: exec distlib-run --nnodes 2 --nproc-per-node 2 --run-id r --node-rank 1 x.py\n",
            "launcher-1": "[rank5] WARNING distlib.join: something\n"}
    assert container_of_ranks(logs) == {0: "worker-2", 1: "worker-2", 2: "worker-1", 3: "worker-1", 5: "launcher-1"}


def test_the_pieces():
    assert [w.rank for w in latest_waits(LOGS)] == [0]
    assert latest_waits(LOGS)[0].missing == (1, 2, 3) and latest_waits(LOGS)[0].after == "15.0s"
    assert container_of_ranks(LOGS) == {0: "worker-1", 1: "worker-2", 2: "worker-3", 3: "worker-4"}
    assert last_word("") is None and last_word("a\n\nb\n") == "b"
