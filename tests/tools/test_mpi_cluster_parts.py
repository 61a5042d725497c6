"""The parts of the Compose cluster's MODE=mpi that run without Docker: the rank's parent that
records how a rank ended (real processes, real signals), the launcher's plan and mpirun
command, both sides' SSH configuration, the per-run key pair (the host's ssh-keygen), and the
report's node and local ranks. The cluster itself runs in tests/containers/test_compose_cluster.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlib_deploy.cluster import ssh_keys
from distlib.command import ToolError
from distlib_deploy.jobs import _common, mpi_launch, mpi_rank, mpi_sshd

ROOT = Path(__file__).resolve().parents[2]


def wrapped(record_dir: Path, code: str, env=None) -> subprocess.Popen:
    """``python -m distlib_deploy.jobs.mpi_rank`` around ``python -c code``, as mpirun starts it."""
    return subprocess.Popen([sys.executable, "-m", "distlib_deploy.jobs.mpi_rank", "--record-dir", str(record_dir),
                             "--", sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def records(record_dir: Path):
    return [json.loads(p.read_text()) for p in sorted(record_dir.glob("rank-*.json"))]


# -- mpi_rank ---------------------------------------------------------------------------------------


def test_a_killed_rank_is_recorded_and_its_parent_ends_by_the_same_signal(tmp_path):
    before = time.time()
    proc = wrapped(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", {"OMPI_COMM_WORLD_RANK": "5"})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL  # what mpirun's daemon sees: as if unwrapped
    (rec,) = records(tmp_path)
    assert (rec["rank"], rec["status"], rec["signal"], rec["what"]) == (5, None, 9, "killed by signal 9 (SIGKILL)")
    assert before <= rec["time"] <= time.time() and rec["host"] == os.uname().nodename
    assert "mpi_rank: rank 5 on" in err and "killed by signal 9 (SIGKILL)" in err


def test_a_rank_gets_torchs_variables_from_mpis(tmp_path):
    """A user's script written for torchrun reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE."""
    mpi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    code = "import os; print(*(os.environ.get(k) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE')))"
    proc = wrapped(tmp_path, code, {k: "" for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} | mpi)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split() == ["3", "4", "1", "2"], err
    assert mpi_rank.torch_env({**mpi, "RANK": "7"}) == {"WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert mpi_rank.torch_env({}) == {}


@pytest.mark.parametrize("status", [0, 3])
def test_the_exit_status_passes_through(tmp_path, status):
    proc = wrapped(tmp_path, f"print('out'); raise SystemExit({status})", {"PMIX_RANK": "2"})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status and out == "out\n"
    (rec,) = records(tmp_path)
    assert (rec["rank"], rec["status"], rec["signal"]) == (2, status, None)
    assert ("exited with status 3" in err) == (status == 3)


def test_signals_reach_the_rank(tmp_path):
    """mpirun's daemon signals the process it started: the rank gets the signal."""
    proc = wrapped(tmp_path, "import signal, sys, time\n"
                             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
                             "print('ready', flush=True)\ntime.sleep(60)")
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == 7
    assert records(tmp_path)[0]["status"] == 7


def test_the_rank_does_not_outlive_its_parent(tmp_path):
    proc = wrapped(tmp_path, "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)")
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):  # dead, waiting for init to reap it
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail(f"the rank (pid {child}) kept running after its parent was killed")


def test_usage_without_a_program():
    done = subprocess.run([sys.executable, "-m", "distlib_deploy.jobs.mpi_rank", "python"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and mpi_rank.USAGE in done.stderr


# -- mpi_launch ---------------------------------------------------------------------------------------


def test_the_plan_puts_ranks_on_nodes_in_address_order():
    nodes = mpi_launch.plan(["10.0.0.2", "10.0.0.3"], 2, {"10.0.0.2": "p-worker-2", "10.0.0.3": "p-worker-1"})
    assert [n.line() for n in nodes] == ["node 0 10.0.0.2 (p-worker-2): ranks 0-1",
                                         "node 1 10.0.0.3 (p-worker-1): ranks 2-3"]
    assert mpi_launch.hostfile_text(nodes) == "10.0.0.2 slots=2\n10.0.0.3 slots=2\n"
    assert mpi_launch.plan(["10.0.0.9"], 1)[0].line() == "node 0 10.0.0.9 (-): rank 0"


def test_the_mpirun_command():
    nodes = mpi_launch.plan(["10.0.0.2", "10.0.0.3", "10.0.0.4"], 1)
    cmd = mpi_launch.mpirun_command(nodes, Path("/h/hostfile"), ["-m", "distlib_deploy.jobs.train_dp", "--epochs", "2"],
                                    "/workspace", "eth0", {"DISTLIB_RUN_ID": "r1", "DISTLIB_LOG_LEVEL": ""})
    text = " ".join(cmd)
    assert cmd[:3] == ["/opt/distlib/bin/mpirun", "--prefix", "/opt/distlib"]
    assert "--hostfile /h/hostfile -n 3 --map-by slot" in text and "--wdir /workspace" in text
    assert "--mca btl_tcp_if_include eth0" in text and "--prtemca oob_tcp_if_include eth0" in text
    assert "--prtemca plm_ssh_no_tree_spawn 1" in text  # only the launcher holds the private key
    assert "-x DISTLIB_BACKEND=mpi" in text and "-x DISTLIB_RUN_ID" in text and "DISTLIB_LOG_LEVEL" not in text
    # a script written for torchrun (env://) finds rank 0's store on node 0
    assert "-x MASTER_ADDR=10.0.0.2 -x MASTER_PORT=29500" in text
    tail = cmd[cmd.index("distlib_deploy.jobs.mpi_rank") - 2:]
    assert tail == ["/opt/distlib/bin/python", "-m", "distlib_deploy.jobs.mpi_rank", "--", "/opt/distlib/bin/python",
                    "-m", "distlib_deploy.jobs.train_dp", "--epochs", "2"]


def test_the_launchers_ssh_client(tmp_path):
    mounted = tmp_path / "mounted_key"
    mounted.write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----\nfake\n")
    mounted.chmod(0o644)
    config = mpi_launch.prepare_client(tmp_path / ".ssh", mounted, "distlib")
    key = tmp_path / ".ssh" / "id_ed25519"
    assert key.read_bytes() == mounted.read_bytes() and key.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / ".ssh").stat().st_mode & 0o777 == 0o700
    text = config.read_text()
    for line in ("Port 2222", "User distlib", f"IdentityFile {key}", "IdentitiesOnly yes", "BatchMode yes",
                 "StrictHostKeyChecking yes", f"UserKnownHostsFile {tmp_path / '.ssh' / 'known_hosts'}"):
        assert f"    {line}\n" in text
    with pytest.raises(ToolError, match="private key is not mounted at /nonexistent"):
        mpi_launch.prepare_client(tmp_path / "other", Path("/nonexistent/id_ed25519"), "distlib")


# -- mpi_sshd -------------------------------------------------------------------------------------------


def test_the_workers_sshd_admits_the_run_key_only(tmp_path):
    if shutil.which("ssh-keygen") is None:
        pytest.skip("no ssh-keygen here")
    mounted = tmp_path / "authorized_keys"
    mounted.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeFakeFakeFakeFakeFakeFakeFakeFakeFakeFake run\n")
    mounted.chmod(0o644)
    config = mpi_sshd.prepare(tmp_path / ".sshd", mounted, "distlib")
    d = tmp_path / ".sshd"
    assert d.stat().st_mode & 0o777 == 0o700
    assert (d / "authorized_keys").read_text() == mounted.read_text()
    assert (d / "authorized_keys").stat().st_mode & 0o777 == 0o600  # sshd's StrictModes, whoever owns the mount
    assert (d / "host_ed25519_key.pub").read_text().startswith("ssh-ed25519 ")
    text = config.read_text().splitlines()
    for line in ("Port 2222", f"HostKey {d}/host_ed25519_key", f"AuthorizedKeysFile {d}/authorized_keys",
                 "AllowUsers distlib", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                 "PermitRootLogin no", "UsePAM no", "StrictModes yes", "AllowTcpForwarding no", "X11Forwarding no"):
        assert line in text
    first_key = (d / "host_ed25519_key.pub").read_text()
    mpi_sshd.prepare(d, mounted, "distlib")  # a restarted container: a new host key
    assert (d / "host_ed25519_key.pub").read_text() != first_key
    with pytest.raises(ToolError, match="public key is not mounted at /nonexistent"):
        mpi_sshd.prepare(tmp_path / "x", Path("/nonexistent/authorized_keys"), "distlib")


SSHD_LOG = [
    b"Server listening on 0.0.0.0 port 2222.\n",
    b"Connection closed by 172.18.0.5 port 41234 [preauth]\n",  # ssh-keyscan: a probe
    b"Connection reset by fd00::5 port 41236 [preauth]\n",  # a probe over IPv6
    b"Connection closed by authenticating user distlib 172.18.0.5 port 41240 [preauth]\n",  # a failed login
    b"Invalid user root from 172.18.0.9 port 50000\n",
    b"Accepted publickey for distlib from 172.18.0.5 port 41238 ssh2: ED25519 SHA256:abc\n",
]


def test_the_sshd_log_loses_the_probes_and_keeps_every_login(tmp_path):
    source, sink = tmp_path / "in", tmp_path / "out"
    source.write_bytes(b"".join(SSHD_LOG))
    with open(source, "rb") as src, open(sink, "wb") as out:
        dropped = mpi_sshd.log_filter(src, out)
    assert dropped == 2
    assert sink.read_bytes().splitlines(keepends=True) == [SSHD_LOG[0]] + SSHD_LOG[3:]


@pytest.mark.parametrize("level, shown", [("DEBUG", True), ("debug", True), ("INFO", False), ("WARNING", False),
                                          ("ERROR", False), ("nonsense", False)])
def test_the_probes_are_debug_lines(level, shown):
    assert mpi_sshd.shows_probes(level) is shown


def test_what_the_exec_ed_program_writes_to_stderr_goes_through_the_filter():
    """filter_stderr, then exec (as main() execs sshd): the program's stderr loses the probes'
    lines, keeps the others in order, and the filter ends when the program does."""
    lines = "".join(line.decode() for line in SSHD_LOG)
    code = ("import os, sys; from distlib_deploy.jobs import mpi_sshd; mpi_sshd.filter_stderr(); "
            "os.execv('/bin/sh', ['sh', '-c', 'printf \"%s\" \"$0\" >&2', sys.argv[1]])")
    done = subprocess.run([sys.executable, "-c", code, lines], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines(keepends=True) == [SSHD_LOG[0]] + SSHD_LOG[3:]


# -- the run's key pair ------------------------------------------------------------------------------------


def test_a_new_key_pair_per_run(tmp_path):
    if shutil.which("ssh-keygen") is None:
        pytest.skip("no ssh-keygen here (the image's is used then: tests/containers)")
    a = ssh_keys.make(tmp_path / "a" / "ssh", "mpirun@distlib-a")
    b = ssh_keys.make(tmp_path / "b" / "ssh", "mpirun@distlib-b")
    assert a.directory.stat().st_mode & 0o777 == 0o700  # no other host user can reach the key
    for path in (a.private, a.authorized_keys):
        assert path.stat().st_mode & 0o777 == 0o644  # readable by the containers' uid 1000
    assert a.private.read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    public = a.authorized_keys.read_text()
    assert public.startswith("ssh-ed25519 ") and public.strip().endswith("mpirun@distlib-a")
    copy = tmp_path / "copy"  # ssh-keygen reads a private key of its user's only with mode 600
    copy.write_bytes(a.private.read_bytes())
    copy.chmod(0o600)
    derived = subprocess.run(["ssh-keygen", "-y", "-f", str(copy)], capture_output=True, text=True, timeout=30)
    assert derived.stdout.split()[:2] == public.split()[:2], derived.stderr
    assert a.private.read_bytes() != b.private.read_bytes()
    ssh_keys.remove(a.directory)
    assert not a.directory.exists()


# -- the report's placement ----------------------------------------------------------------------------------


def test_node_and_local_ranks_from_hosts_where_no_launcher_set_them():
    facts = [{"rank": r, "host": h, "node_rank": None, "local_rank": None}
             for r, h in enumerate(["b", "b", "a", "a", "c"])]
    _common.place(facts)
    assert [(f["node_rank"], f["local_rank"]) for f in facts] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    set_by_launcher = [{"rank": 0, "host": "x", "node_rank": 3, "local_rank": 1}]
    _common.place(set_by_launcher)
    assert (set_by_launcher[0]["node_rank"], set_by_launcher[0]["local_rank"]) == (3, 1)
