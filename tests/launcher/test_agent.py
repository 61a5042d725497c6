"""Real launches on localhost: distlib-run processes, their workers, a store server, signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from .conftest import StreamText, clean_env, free_port, pid_alive, run_launcher, start_launcher, wait_for

pytestmark = pytest.mark.timeout(120)

# A worker that reports its environment and rendezvous through env:// (distlib.rendezvous):
# publishes a key, reads every rank's, and waits until all have read before leaving.
EXCHANGE = textwrap.dedent("""
    import json, os, sys
    from datetime import timedelta
    from distlib.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", timeout=timedelta(seconds=30)))
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "DISTLIB_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS"]
    env = {k: os.environ.get(k) for k in names}
    store.set(f"rank/{rank}", json.dumps({"pid": os.getpid(), "argv": sys.argv[1:]}))
    seen = {r: json.loads(store.get(f"rank/{r}"))["pid"] for r in range(world)}
    if store.add("done", 1) == world:
        store.set("all_done", "1")
    store.wait(["all_done"], timedelta(seconds=30))
    # rank 0 may host the store: it leaves last, once every other rank has had its last reply
    if rank == 0:
        store.wait([f"left/{r}" for r in range(1, world)], timedelta(seconds=30))
    else:
        store.set(f"left/{rank}", "1")
    # one write per report: the workers of a node share the launcher's stdout
    report = json.dumps({"rank": rank, "world": world, "env": env, "store": type(store).__name__,
                         "seen": sorted(seen)})
    os.write(1, (report + "\\n").encode())
""")


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def reports(stdout: str):
    """The workers' JSON reports; each line carries its writer's rank in front (``[rankN]: ``)."""
    found = []
    for line in stdout.splitlines():
        m = re.fullmatch(r"\[rank(\d+)\]: (\{.*\})", line)
        if m:
            report = json.loads(m.group(2))
            assert report["rank"] == int(m.group(1)), f"line prefixed with rank {m.group(1)}: {line}"
            found.append(report)
    return found


def test_two_nodes_two_procs_static(tmp_path):
    script = write(tmp_path, "exchange.py", EXCHANGE)
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--run-id", "static-test"]
    nodes = [start_launcher(*common, "--node-rank", str(n), script, "--flag", "x y") for n in (1, 0)]
    outs = []
    for proc in nodes:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outs.append((out, err))
    got = {r["rank"]: r for out, _ in outs for r in reports(out)}
    assert sorted(got) == [0, 1, 2, 3]
    for rank, r in got.items():
        env = r["env"]
        assert env == {
            "RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(rank // 2), "NODE_RANK": str(rank // 2), "GROUP_WORLD_SIZE": "2",
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "static-test", "DISTLIB_RUN_ID": "static-test",
            "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1",
        }
        assert r["seen"] == [0, 1, 2, 3] and r["world"] == 4
        assert r["store"] == "TCPStore"  # rank 0 hosts it: no run-id prefix in static mode
    # node 1's launcher printed the ranks of node 1 only
    assert sorted(r["rank"] for r in reports(outs[0][0])) == [2, 3]
    assert "node 1 of 2: starting 2 worker(s), global ranks 2..3 of 4" in outs[0][1]


def test_c10d_node_rank_auto_three_nodes(tmp_path, store_server):
    from distlib.store.tcp import TCPStore

    script = write(tmp_path, "exchange.py", EXCHANGE)
    run_id = f"auto-{uuid.uuid4().hex[:8]}"
    args = ["--nnodes", "3", "--nproc-per-node", "1", "--node-rank", "auto", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{store_server}", "--run-id", run_id, script]
    nodes = [start_launcher(*args) for _ in range(3)]
    got = []
    for proc in nodes:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert re.search(r"node rank \d taken from the master service", err)
        got += reports(out)
    assert sorted(int(r["env"]["GROUP_RANK"]) for r in got) == [0, 1, 2]
    assert sorted(r["rank"] for r in got) == [0, 1, 2]
    for r in got:
        assert r["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert r["env"]["MASTER_PORT"] == str(store_server)
        assert r["store"] == "PrefixStore"  # every rank a client, keys under the run id
        assert r["seen"] == [0, 1, 2]

    raw = TCPStore("127.0.0.1", store_server, None, False, 10)
    try:
        assert raw.add(f"distlib/run/{run_id}/node_rank", 0) == 3
        assert raw.check([f"distlib/run/{run_id}/rank/0", f"distlib/run/{run_id}/all_done"])
    finally:
        raw.close()

    # a fourth launcher of the same run finds the counter past nnodes-1
    late = run_launcher(*args, timeout=60)
    assert late.returncode == 1
    assert "handed out node rank 3, but the run has 3 node(s)" in late.stderr
    assert "give every run its own --run-id" in late.stderr


def test_c10d_agent_hosts_the_store_when_nothing_answers(tmp_path):
    script = write(tmp_path, "exchange.py", EXCHANGE)
    port = free_port()
    done = run_launcher("--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                        "--run-id", "hosted", script)
    assert done.returncode == 0, done.stderr
    assert "this agent hosts one in-process" in done.stderr
    got = reports(done.stdout)
    assert sorted(r["rank"] for r in got) == [0, 1]
    assert {r["store"] for r in got} == {"PrefixStore"}


def test_standalone(tmp_path):
    script = write(tmp_path, "exchange.py", EXCHANGE)
    done = run_launcher("--standalone", "--nproc-per-node", "2", script)
    assert done.returncode == 0, done.stderr
    got = reports(done.stdout)
    assert sorted(r["rank"] for r in got) == [0, 1]
    assert {r["env"]["MASTER_PORT"] for r in got} != {"0"}


def test_c10d_unreachable_endpoint_fails_fast_and_names_it(tmp_path):
    script = write(tmp_path, "never.py", "raise SystemExit('should not run')\n")
    started = time.monotonic()
    done = run_launcher("--rdzv-backend", "c10d", "--rdzv-endpoint", "192.0.2.1:29999", "--run-id", "r",
                        "--rdzv-timeout", "1", script)
    assert done.returncode == 1
    assert "no distlib store-server answered at 192.0.2.1:29999 within 1.0s" in done.stderr
    assert "should not run" not in done.stderr
    assert time.monotonic() - started < 30


def test_an_endpoint_that_answers_wrongly_fails_saying_how_soon_not_the_timeout():
    """Something that is no store server answers at the endpoint: the error says it failed after
    a moment, not "within 5m00s" (the --rdzv-timeout that did not run out)."""
    import socket
    import threading

    from distlib.launcher.master import LauncherError, ensure_master_service

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_wrongly() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    threading.Thread(target=answer_wrongly, daemon=True).start()
    try:
        with pytest.raises(LauncherError) as caught:
            ensure_master_service("127.0.0.1", port, 300.0)
    finally:
        listener.close()
    text = str(caught.value)
    assert re.match(rf"the master service at 127.0.0.1:{port} failed after \S+ \(of up to 5m00s\)", text), text
    assert "within 5m00s" not in text and "answered, but not as a TCPStore server" in text, text


FAILING = textwrap.dedent("""
    import os, signal, sys, time
    local = int(os.environ["LOCAL_RANK"])
    with open(os.path.join(sys.argv[1], f"pid{local}"), "w") as f:
        f.write(str(os.getpid()))
    if local == 1:
        while not os.path.exists(os.path.join(sys.argv[1], "pid0")):
            time.sleep(0.01)
        if sys.argv[2] == "exit":
            for i in range(30):
                print(f"boom line {i}", file=sys.stderr)
            sys.exit(3)
        print("about to die", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    print("sleeping", flush=True)
    time.sleep(60)
""")


def test_worker_exit_code_stops_the_others(tmp_path):
    script = write(tmp_path, "failing.py", FAILING)
    started = time.monotonic()
    done = run_launcher("--nproc-per-node", "2", "--grace-period", "5", script, str(tmp_path), "exit")
    elapsed = time.monotonic() - started
    assert done.returncode == 3, done.stderr
    assert elapsed < 20
    err = done.stderr
    assert "worker failed: global rank 1 (local rank 1) on node 0 of 1 exited with code 3" in err
    assert "last 20 line(s) of its stderr:" in err
    assert "distlib-run:   | boom line 29" in err and "distlib-run:   | boom line 10" in err
    assert "distlib-run:   | boom line 9\n" not in err
    assert "boom line 0\n" in err  # the stderr itself passed through live, all of it
    assert "stopped the other worker(s): global rank 0 (local rank 0) (SIGTERM)" in err
    sleeper = int((tmp_path / "pid0").read_text())
    assert not pid_alive(sleeper)


def test_worker_killed_by_a_signal_is_named(tmp_path):
    script = write(tmp_path, "failing.py", FAILING)
    done = run_launcher("--nproc-per-node", "2", script, str(tmp_path), "kill")
    assert done.returncode == 128 + 9, done.stderr
    assert "global rank 1 (local rank 1) on node 0 of 1 was killed by signal SIGKILL (9)" in done.stderr
    assert "  | about to die" in done.stderr
    assert not pid_alive(int((tmp_path / "pid0").read_text()))


def test_rank_on_a_later_node_is_named(tmp_path):
    script = write(tmp_path, "fail.py", "import sys; print('no', file=sys.stderr); sys.exit(5)\n")
    done = run_launcher("--nnodes", "3", "--node-rank", "2", "--nproc-per-node", "1", "--master-port",
                        str(free_port()), script)
    assert done.returncode == 5
    assert "worker failed: global rank 2 (local rank 0) on node 2 of 3 exited with code 5" in done.stderr


SLEEPERS = textwrap.dedent("""
    import os, signal, sys, time
    local = int(os.environ["LOCAL_RANK"])
    d = sys.argv[1]
    def on_term(signum, frame):
        open(os.path.join(d, f"term{local}"), "w").close()
        if not (local == 1 and sys.argv[2] == "stubborn"):
            sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    with open(os.path.join(d, f"pid{local}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(d, f"pid{local}.tmp"), os.path.join(d, f"pid{local}"))  # whole or absent
    while True:
        time.sleep(0.05)
""")


def wait_for_pids(directory, n: int) -> list:
    """The pids SLEEPERS' ``n`` workers wrote into ``directory``, once all are there."""
    paths = [directory / f"pid{i}" for i in range(n)]
    wait_for(lambda: all(p.exists() for p in paths), 30, f"the pid files of {n} workers")
    return [int(p.read_text()) for p in paths]


@pytest.mark.parametrize("mode", ["polite", "stubborn"])
def test_sigterm_to_the_launcher_stops_its_workers(tmp_path, mode):
    script = write(tmp_path, "sleepers.py", SLEEPERS)
    proc = start_launcher("--nproc-per-node", "2", "--grace-period", "1", script, str(tmp_path), mode)
    try:
        # each worker writes its pid file after installing its handler, and the launcher
        # installed its own before starting them: once both are there, SIGTERM finds all three
        pids = wait_for_pids(tmp_path, 2)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM: forwarding it to 2 running worker(s)" in err
    assert (tmp_path / "term0").exists() and (tmp_path / "term1").exists()  # SIGTERM was forwarded
    assert not any(pid_alive(p) for p in pids)
    if mode == "stubborn":
        assert "still running SIGTERM after" in err and "sending SIGKILL" in err
        assert 0.9 < elapsed < 15
    else:
        assert elapsed < 5


#: Given a directory, rank 0 waits there for the test's "go" between its partial line and the
#: rest (the test gives it once the console showed the partial line on its own), and rank 1 for
#: the test's "done", given once the console showed rank 0's whole line: the order the test
#: needs, observed on the console, not slept for. (A file rank 0 wrote after its line would say
#: the line reached rank 0's pipe, not the console: rank 1's pump could pass its line on first.)
OUTPUT = textwrap.dedent("""
    import os, sys, time
    r = os.environ["LOCAL_RANK"]
    d = sys.argv[1] if len(sys.argv) > 1 else None

    def await_file(name):
        path, deadline = os.path.join(d, name), time.monotonic() + 60
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                sys.exit(f"rank {r}: no {path} after 60 s")
            time.sleep(0.01)

    sys.stdout.write(f"out {r} line\\nout {r} no newline")
    sys.stdout.flush()
    if r == "0":
        sys.stderr.write("err 0 partial")
        sys.stderr.flush()
        if d:
            await_file("go")
        sys.stderr.write(" continued\\n")
        sys.stderr.flush()
    else:
        if d:
            await_file("done")
        sys.stderr.write("err 1 whole\\n")
""")


def test_output_lines_carry_the_rank_and_stay_on_their_stream(tmp_path):
    """A partial line is passed on after a silence, and its continuation gets no second prefix:
    the console shows rank 0's partial line before rank 0 writes the rest."""
    script = write(tmp_path, "out.py", OUTPUT)
    proc = start_launcher("--nproc-per-node", "2", script, str(tmp_path))
    err = StreamText(proc.stderr)
    try:
        err.wait_for("[rank0]: err 0 partial", 30)
        assert "continued" not in err.text  # rank 0 is still waiting for the go
        (tmp_path / "go").touch()
        err.wait_for("[rank0]: err 0 partial continued\n", 30)
        (tmp_path / "done").touch()
        proc.wait(timeout=60)  # (stderr is StreamText's to read, so no communicate())
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    stderr = err.rest()
    assert proc.returncode == 0, stderr
    assert sorted(out.splitlines()) == ["[rank0]: out 0 line", "[rank0]: out 0 no newline",
                                        "[rank1]: out 1 line", "[rank1]: out 1 no newline"]
    assert "[rank0]: err 0 partial continued\n" in stderr and "[rank1]: err 1 whole\n" in stderr, stderr


def test_an_empty_prefix_template_passes_lines_unchanged(tmp_path):
    script = write(tmp_path, "out.py", OUTPUT)
    done = run_launcher("--nproc-per-node", "2", "--log-line-prefix-template", "", script)
    assert sorted(done.stdout.splitlines()) == ["out 0 line", "out 0 no newline", "out 1 line", "out 1 no newline"]


def test_local_ranks_filter_and_tee_and_redirects(tmp_path):
    """--local-ranks-filter 1: only rank 1 on the console; --tee 1 copies stdout to files,
    -r 0:2 sends rank 0's stderr to its file only (torch's forms and layout)."""
    script = write(tmp_path, "out.py", OUTPUT)
    logs = tmp_path / "logs"
    done = run_launcher("--nproc-per-node", "2", "--local-ranks-filter", "1", "--tee", "1", "-r", "0:2",
                        "--log-dir", str(logs), "--run-id", "out-1", script)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[rank1]: out 1 line", "[rank1]: out 1 no newline"]
    assert "err 0" not in done.stderr and "[rank1]: err 1 whole\n" in done.stderr
    (run_dir,) = logs.iterdir()
    assert run_dir.name.startswith("out-1_")
    attempt = run_dir / "attempt_0"
    assert (attempt / "0" / "stdout.log").read_text() == "out 0 line\nout 0 no newline"
    assert (attempt / "1" / "stdout.log").read_text() == "out 1 line\nout 1 no newline"
    assert (attempt / "0" / "stderr.log").read_text() == "err 0 partial continued\n"
    assert not (attempt / "1" / "stderr.log").exists()


@pytest.mark.parametrize("flags, words", [
    (["--tee", "4"], "--tee '4': 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
    (["-r", "0:1,x"], "--redirects '0:1,x': give 0..3 for every local rank"),
    (["--local-ranks-filter", "a"], "--local-ranks-filter 'a': local ranks separated by commas"),
])
def test_bad_output_flags_exit_2_saying_what_is_wrong(tmp_path, flags, words):
    done = run_launcher(*flags, "x.py")
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_module_and_arguments(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text("import os, sys; print(os.environ['RANK'], sys.argv[1:])\n")
    done = run_launcher("-m", "mypkg.job", "--nnodes", "7", "pos",
                        env=clean_env(PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[rank0]: 0 ['--nnodes', '7', 'pos']\n"


def test_dry_run(tmp_path):
    env = clean_env(JOB_COMPLETION_INDEX="1", DISTLIB_RUN_ID="run-7")
    env.pop("OMP_NUM_THREADS")
    done = run_launcher("--dry-run", "--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "node0",
                        "does-not-exist.py", "--lr", "0.1", env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "nothing started, nothing contacted" in out
    assert re.search(r"^  node-rank\s+1\s+from JOB_COMPLETION_INDEX$", out, re.M)
    assert re.search(r"^  nnodes\s+2\s+from flag --nnodes$", out, re.M)
    assert re.search(r"^  master-addr\s+node0\s+from flag --master-addr", out, re.M)
    assert re.search(r"^  master-port\s+29500\s+from default$", out, re.M)
    assert re.search(r"^  run-id\s+run-7\s+from DISTLIB_RUN_ID$", out, re.M)
    assert re.search(r"^  OMP_NUM_THREADS\s+1\s+from default", out, re.M)
    assert "does-not-exist.py --lr 0.1" in out
    blocks = out.split("worker local rank ")[1:]
    assert len(blocks) == 2
    assert "  RANK=2\n" in blocks[0] and "  RANK=3\n" in blocks[1]
    assert "  GROUP_RANK=1\n" in blocks[1] and "  MASTER_ADDR=node0\n" in blocks[1]


def test_dry_run_with_node_rank_auto():
    done = run_launcher("--dry-run", "--nnodes", "3", "--node-rank", "auto", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", "master:29500", "x.py")
    assert done.returncode == 0, done.stderr
    assert re.search(r"^  node-rank\s+auto\s+from flag --node-rank auto", done.stdout, re.M)
    assert "  RANK=auto\n" in done.stdout and "  TORCHELASTIC_USE_AGENT_STORE=True\n" in done.stdout
    assert "distinct ids" in done.stdout  # the default run id on a master service is warned about


def test_configuration_errors_exit_2(tmp_path):
    done = run_launcher("--nnodes", "2", "--node-rank", "2", "x.py")
    assert done.returncode == 2
    assert "distlib-run: error: node rank 2 (from flag --node-rank) is out of range for 2 node(s)" in done.stderr
    done = run_launcher("--nnodes", "2")
    assert done.returncode == 2 and "what to run is missing" in done.stderr


def test_distlib_run_subcommand():
    done = subprocess.run([sys.executable, "-m", "distlib.cli", "run", "--dry-run", "--nproc-per-node", "3", "x.py"],
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^  nproc-per-node\s+3\s+from flag --nproc-per-node$", done.stdout, re.M)


#: Rank 1 goes on using the store after node 0's agent said it keeps it for other nodes (the
#: test gives the go once it did: node 0's worker is done by then).
LATE_LEAVER = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    from distlib.rendezvous import rendezvous
    store, rank, world = next(rendezvous("env://", timeout=timedelta(seconds=30)))
    store.set(f"hello/{rank}", str(rank))
    store.wait([f"hello/{r}" for r in range(world)], timedelta(seconds=30))
    if rank == 1:
        go, deadline = os.path.join(sys.argv[1], "go"), time.monotonic() + 60
        while not os.path.exists(go):
            assert time.monotonic() < deadline, f"no {go} after 60 s"
            time.sleep(0.01)
    store.set(f"bye/{rank}", "1")
    assert store.get(f"bye/{rank}") == b"1"
    print(f"rank {rank} done", flush=True)
""")


def test_hosting_agent_keeps_the_store_for_other_nodes(tmp_path):
    script = write(tmp_path, "late.py", LATE_LEAVER)
    port = free_port()
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--run-id", "linger"]
    node0 = start_launcher(*args, "--node-rank", "0", script, str(tmp_path))
    node1 = None
    err0 = StreamText(node0.stderr)
    try:
        err0.wait_for("this agent hosts one in-process", 30)  # node 0 found nothing there: it hosts
        node1 = start_launcher(*args, "--node-rank", "1", script, str(tmp_path))
        err0.wait_for("keeping the store server on port", 60)  # its worker is done, node 1's is not
        assert node0.poll() is None
        (tmp_path / "go").touch()
        out1, err1 = node1.communicate(timeout=60)
        node0.wait(timeout=60)
        out0 = node0.stdout.read()
    finally:
        for proc in (node0, node1):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert node0.returncode == 0, err0.rest()
    assert node1.returncode == 0, err1
    assert out0 == "[rank0]: rank 0 done\n" and out1 == "[rank1]: rank 1 done\n"


def test_workers_die_with_a_killed_launcher(tmp_path):
    script = write(tmp_path, "sleepers.py", SLEEPERS)
    proc = start_launcher("--nproc-per-node", "2", script, str(tmp_path), "polite")
    try:
        pids = wait_for_pids(tmp_path, 2)
        proc.kill()  # SIGKILL: no chance to forward anything
        proc.wait(10)
        wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "the orphaned workers to die")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_a_workers_error_file_is_quoted_in_the_failure_report(tmp_path):
    """With a log directory each worker gets TORCHELASTIC_ERROR_FILE; what torch's @record writes
    there (JSON, its format) is quoted when the worker fails."""
    script = write(tmp_path, "rec.py", textwrap.dedent("""
        import json, os, sys
        path = os.environ["TORCHELASTIC_ERROR_FILE"]
        with open(path, "w") as f:
            json.dump({"message": {"message": "RuntimeError: the data loader ran dry",
                                   "extraInfo": {"py_callstack": "...", "timestamp": "0"}}}, f)
        sys.exit(1)
    """))
    done = run_launcher("--log-dir", str(tmp_path / "logs"), "--run-id", "rec", script)
    assert done.returncode == 1
    assert re.search(r"its error file \(\S+/attempt_0/0/error\.json, written by @record\): RuntimeError: the data "
                     r"loader ran dry", done.stderr), done.stderr


# A user's unmodified training script, as in docs/cluster.md: no init_method, no rank.
USER_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import distlib as dist
    from distlib.group import world

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = np.full(4, rank + 1, np.int64)
    dist.all_reduce(x)
    print(json.dumps({"rank": rank, "world": dist.get_world_size(), "all_reduce": x.tolist(),
                      "store": world.default_store.underlying_store.describe()}), flush=True)
    dist.destroy_process_group()
""")


def test_an_unmodified_script_meets_through_the_launchers_init_method(tmp_path):
    """The cluster's file modes: distlib-run passes DISTLIB_INIT_METHOD (a FileStore) on, and
    MASTER_ADDR:MASTER_PORT is not the job's store (here a port another program holds, as a
    container's loopback holds nothing of rank 0's). ``init_process_group("gloo")`` must meet
    through the FileStore, with the launcher's RANK and WORLD_SIZE."""
    import socket

    script = write(tmp_path, "my_train.py", USER_SCRIPT)
    store_file = tmp_path / "shared" / "store"
    store_file.parent.mkdir()
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen(1)  # something that is not a store holds MASTER_PORT
    port = other.getsockname()[1]
    env = clean_env(DISTLIB_INIT_METHOD=f"file://{store_file}")
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--run-id", "file-mode", "--rdzv-timeout", "30"]
    try:
        nodes = [start_launcher(*common, "--node-rank", str(n), script, env=env) for n in (1, 0)]
        outs = [proc.communicate(timeout=90) for proc in nodes]
    finally:
        other.close()
    for proc, (_out, err) in zip(nodes, outs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    got = {r["rank"]: r for out, _ in outs for r in reports(out)}
    assert sorted(got) == [0, 1], outs
    for rank, r in got.items():
        assert (r["world"], r["all_reduce"]) == (2, [3, 3, 3, 3]), (rank, r)
        assert r["store"] == f"FileStore {store_file}", (rank, r)
