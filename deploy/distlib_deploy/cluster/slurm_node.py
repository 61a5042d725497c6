"""The entry point of a Slurm container (docker/slurm/Dockerfile): this container's part of a
real Slurm 22.05 cluster, the controller or a compute node.

    python -m distlib_deploy.cluster.slurm_node node
    python -m distlib_deploy.cluster.slurm_node controller [--submit]

Every container first names the nodes: the ``NODES`` containers answering to the DNS name
``CLUSTER_SERVICE`` (Compose gives replicas no index), in numeric address order, are
``node01``, ``node02``, ...; each container writes that table into its /etc/hosts (the
stand-in for a cluster's DNS: Slurm and the jobs' MASTER_ADDR both use node names). Then it
writes the same slurm.conf (``slurm_conf``), installs the cluster's munge key (made per
cluster, mounted at ``MUNGE_KEY``) and starts munged. A node then becomes ``slurmd -D -N
<its name>``; the controller starts ``slurmctld`` and waits until every node is idle. With
``--submit`` (``MODE=slurm make cluster-up``) it then submits the job as the image's user
(``sbatch --wait``, the batch script of ``batch_script``), prints its output as it is
written, and exits with its status; without, it serves until stopped (the tests run srun in
it).

Environment: ``NODES``; ``CLUSTER_SERVICE`` (default ``worker``); ``MUNGE_KEY`` (default
/run/secrets/distlib/munge.key); ``SLURM_CPUS`` (CPUs per node in slurm.conf, default this
container's count: a node that claims more than it has is drained); ``CLUSTER_DNS_TIMEOUT``
and ``SLURM_UP_TIMEOUT`` (seconds, default 120 and 90). For ``--submit``: ``NPROC_PER_NODE``,
``JOB``/``JOB_MODULE``/``JOB_ARGS`` (as compose_node reads them), ``JOB_WORKDIR`` (the job's
directory on the nodes), and what the tasks must see: ``DISTLIB_AUTH_TOKEN_FILE``,
``DISTLIB_LOG_LEVEL``, ``GLOO_SOCKET_IFNAME`` (passed on by sbatch, whose environment every
task inherits).
"""

from __future__ import annotations

import argparse
import os
import pwd
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from distlib.command import ToolError, run
from ..jobs.compose_node import program_from_env, wait_for_workers
from distlib.subprocesses import stop as stop_process

PREFIX = "slurm_node:"
CONF = Path("/etc/slurm/slurm.conf")
MUNGE_KEY = "/run/secrets/distlib/munge.key"
CTLD_LOG = Path("/var/log/slurm/slurmctld.log")
HOSTS_MARK = "# distlib slurm nodes"
JOB_USER = "distlib"
#: Seconds sbatch may take to say the job's id (it then waits for the job: CLUSTER_TIMEOUT,
#: on the host, bounds that).
SUBMIT_TIMEOUT_S = 60
#: The default job's report, on the volume all nodes share (cluster up prints it).
REPORT_ARGS = ["--report-json", "/workspace/report.json", "--report-text", "/workspace/report.txt"]
#: Variables of the controller's environment the job's tasks get (sbatch passes its own on).
PASSED_TO_TASKS = ("DISTLIB_AUTH_TOKEN_FILE", "DISTLIB_LOG_LEVEL", "DISTLIB_DEBUG", "GLOO_SOCKET_IFNAME",
                   "OMP_NUM_THREADS", "NCCL_DEBUG", "LANG")


def log(text: str) -> None:
    print(f"{PREFIX} {text}", file=sys.stderr, flush=True)


def node_names(count: int) -> List[str]:
    """``node01`` .. : zero-padded to two digits at least, so that Slurm's lists show padding."""
    width = max(2, len(str(count)))
    return [f"node{i:0{width}d}" for i in range(1, count + 1)]


def slurm_conf(names: Sequence[str], cpus: int) -> str:
    """slurm.conf for ``names`` nodes of ``cpus`` CPUs, controller ``slurmctld``, as unprivileged
    containers allow: no cgroups (proctrack/linuxproc, task/none), no accounting, no resource
    limits propagated (a container may not raise them), the daemons as root."""
    return "\n".join([
        "# written by distlib_deploy.cluster.slurm_node: the same in every container of the cluster",
        "ClusterName=distlib",
        "SlurmctldHost=slurmctld",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "StateSaveLocation=/var/spool/slurmctld",
        "SlurmdSpoolDir=/var/spool/slurmd",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "PropagateResourceLimits=NONE",
        "ReturnToService=2",
        "SlurmdTimeout=60",
        "MessageTimeout=10",
        "KillWait=5",
        "InactiveLimit=0",
        "MinJobAge=600",
        f"NodeName={','.join(names)} CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 State=UNKNOWN",
        "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def hosts_table(names: Sequence[str], addresses: Sequence[str]) -> str:
    return "".join(f"{address}\t{name}\n" for name, address in zip(names, addresses, strict=True))


def write_hosts(table: str, path: Path = Path("/etc/hosts")) -> None:
    """Replace distlib's block of ``path`` with ``table`` (Docker's own lines stay)."""
    lines = path.read_text().split(HOSTS_MARK + "\n", 1)[0]
    path.write_text(lines + HOSTS_MARK + "\n" + table)


def _name_the_nodes(nodes: int, me: Optional[str]) -> "tuple[List[str], List[str]]":
    service = os.environ.get("CLUSTER_SERVICE", "worker")
    timeout = float(os.environ.get("CLUSTER_DNS_TIMEOUT", "120"))
    addresses = wait_for_workers(service, nodes, timeout, me)
    names = node_names(nodes)
    write_hosts(hosts_table(names, addresses))
    return names, addresses


def _configure(names: Sequence[str]) -> None:
    cpus = int(os.environ.get("SLURM_CPUS", "") or os.cpu_count() or 1)
    CONF.parent.mkdir(parents=True, exist_ok=True)
    CONF.write_text(slurm_conf(names, cpus))
    for directory in ("/var/spool/slurmctld", "/var/spool/slurmd", "/var/log/slurm"):
        os.makedirs(directory, exist_ok=True)
    _start_munge(os.environ.get("MUNGE_KEY", MUNGE_KEY))


def _start_munge(source: str) -> None:
    """Install the cluster's key (munge's rules: owned by munge, mode 400) and start munged."""
    if not os.path.isfile(source):
        raise ToolError(f"no munge key at {source}: every cluster gets its own (distlib cluster up makes it and "
                        "mounts it read-only; set MUNGE_KEY to its path)")
    munge = pwd.getpwnam("munge")
    key = Path("/etc/munge/munge.key")
    shutil.copyfile(source, key)
    os.chown(key, munge.pw_uid, munge.pw_gid)
    os.chmod(key, 0o400)
    for directory in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
        os.makedirs(directory, exist_ok=True)
        os.chown(directory, munge.pw_uid, munge.pw_gid)
    done = subprocess.run(["runuser", "-u", "munge", "--", "munged"], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ToolError(f"munged did not start (exit {done.returncode}): {done.stderr.strip()}")
    check = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise ToolError(f"munge does not work here: {check.stderr.strip() or check.stdout.strip()}")


# -- a node -------------------------------------------------------------------------------------


def node() -> int:
    from ..jobs.compose_node import own_address

    nodes = int(os.environ.get("NODES", "1"))
    me = own_address()
    names, addresses = _name_the_nodes(nodes, me)
    name = names[addresses.index(me)]
    _configure(names)
    log(f"{name} ({me}) of {', '.join(names)}: exec slurmd -D -N {name}")
    os.execvp("slurmd", ["slurmd", "-D", "-N", name])
    return 127  # not reached


# -- the controller -----------------------------------------------------------------------------


def _node_states() -> Dict[str, str]:
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30)
    states: Dict[str, str] = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1].lower()
    return states


def _ctld_tail(lines: int = 15) -> str:
    try:
        return "\n".join(CTLD_LOG.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no slurmctld log)"


def wait_until_idle(names: Sequence[str], ctld: subprocess.Popen, timeout: float) -> float:
    """Seconds until every node of ``names`` is idle; ToolError naming the others (and their
    state) after ``timeout``, or at once when slurmctld exits."""
    started = time.monotonic()
    next_log = started + 5
    while True:
        if ctld.poll() is not None:
            raise ToolError(f"slurmctld exited with {ctld.returncode}:\n{_ctld_tail()}")
        states = _node_states()
        waiting = {n: states.get(n, "not registered") for n in names if not states.get(n, "").startswith("idle")}
        now = time.monotonic()
        if not waiting:
            return now - started
        if now - started > timeout:
            raise ToolError(f"after {timeout:.0f} s these Slurm nodes are not idle: "
                            + ", ".join(f"{n} ({s})" for n, s in waiting.items())
                            + f"; slurmctld's log ends:\n{_ctld_tail()}")
        if now >= next_log:
            log(f"waiting for {len(waiting)} of {len(names)} node(s): "
                + ", ".join(f"{n} ({s})" for n, s in waiting.items()))
            next_log = now + 5
        time.sleep(0.25)


def batch_script(nodes: int, nproc: int, program: Sequence[str], workdir: str, output: str) -> str:
    """The job as a Slurm batch script: one task per rank, each `python PROGRAM` (env:// reads
    srun's variables); the same script docs/launcher.md gives to copy."""
    command = " ".join(shlex.quote(word) for word in ["python", "-u", *program])
    return "\n".join([
        "#!/bin/bash",
        "#SBATCH --job-name=distlib-train",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={nproc}",
        "#SBATCH --overcommit",
        f"#SBATCH --chdir={workdir}",
        f"#SBATCH --output={output}",
        "set -eu",
        'echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: $SLURM_NTASKS task(s)"',
        f"srun {command}",
        "",
    ])


def _job_env() -> Dict[str, str]:
    user = pwd.getpwnam(JOB_USER)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": user.pw_dir, "USER": JOB_USER,
           "LOGNAME": JOB_USER, "PYTHONUNBUFFERED": "1"}
    env.update({name: os.environ[name] for name in PASSED_TO_TASKS if os.environ.get(name)})
    return env


def submit(nodes: int) -> int:
    """Submit the job (sbatch --wait as the image's user), print its output as it grows;
    the job's exit status."""
    nproc = int(os.environ.get("NPROC_PER_NODE", "1"))
    program = program_from_env([] if os.environ.get("JOB", "").strip() else REPORT_ARGS)
    workdir = os.environ.get("JOB_WORKDIR", "").strip() or "/workspace"
    output = "/workspace/slurm-%j.out"
    script = Path("/tmp/distlib-job.sbatch")
    script.write_text(batch_script(nodes, nproc, program, workdir, output))
    os.chmod(script, 0o644)
    log(f"submitting {script} as {JOB_USER}: sbatch --wait (the script follows)")
    for line in script.read_text().splitlines():
        log(f"  | {line}")
    sbatch = subprocess.Popen(["runuser", "-u", JOB_USER, "--", "sbatch", "--parsable", "--wait", str(script)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_job_env())
    stdout, stderr = sbatch.stdout, sbatch.stderr
    assert stdout is not None and stderr is not None, "stdout and stderr are PIPEs"
    ready, _, _ = select.select([stdout], [], [], SUBMIT_TIMEOUT_S)  # sbatch prints the id, then waits
    first = stdout.readline().strip() if ready else ""
    job_id = first.split(";", 1)[0]
    if not job_id.isdigit():
        if sbatch.poll() is None:
            sbatch.kill()
        sbatch.wait(10)
        said = " ".join(filter(None, (first, stderr.read().strip())))
        raise ToolError(f"sbatch did not submit the job within {SUBMIT_TIMEOUT_S} s (exit {sbatch.returncode}): "
                        f"{said or 'it said nothing'}")
    log(f"job {job_id} submitted; its output ({output.replace('%j', job_id)}):")
    path = Path(output.replace("%j", job_id))
    offset = 0

    def drain() -> None:
        nonlocal offset
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return
        cut = data.rfind(b"\n") + 1
        if cut:
            sys.stdout.write(data[:cut].decode("utf-8", "replace"))
            sys.stdout.flush()
            offset += cut

    while sbatch.poll() is None:
        drain()
        time.sleep(0.25)
    drain()
    status = sbatch.returncode
    err = stderr.read().strip()
    state = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True, timeout=30)
    fields = dict(item.split("=", 1) for item in state.stdout.split() if "=" in item)
    log(f"job {job_id} ended: JobState={fields.get('JobState', '?')} ExitCode={fields.get('ExitCode', '?')} "
        f"(sbatch --wait exited with {status}){': ' + err if err else ''}")
    return status


def controller(do_submit: bool) -> int:
    nodes = int(os.environ.get("NODES", "1"))
    names, _addresses = _name_the_nodes(nodes, None)
    _configure(names)
    started = time.monotonic()
    with open(CTLD_LOG, "ab") as out:
        ctld = subprocess.Popen(["slurmctld", "-D", "-i"], stdout=out, stderr=subprocess.STDOUT)
    stop = {"now": False}

    def on_term(signum, _frame):
        stop["now"] = True
        ctld.terminate()

    signal.signal(signal.SIGTERM, on_term)
    up = wait_until_idle(names, ctld, float(os.environ.get("SLURM_UP_TIMEOUT", "90")))
    log(f"Slurm cluster up: slurmctld and {nodes} idle node(s) ({', '.join(names)}) in "
        f"{time.monotonic() - started:.1f} s ({up:.1f} s for the nodes to register)")
    if not do_submit:
        log("serving (no --submit): srun/sbatch in this container run jobs")
        while ctld.poll() is None:
            time.sleep(0.5)
        return 0 if stop["now"] else (ctld.returncode or 1)
    try:
        return submit(nodes)
    finally:
        stop_process(ctld)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlib_deploy.cluster.slurm_node",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("controller", "node"))
    parser.add_argument("--submit", action="store_true",
                        help="controller: submit the job (JOB/JOB_MODULE) once the nodes are idle; exit with its status")
    args = parser.parse_args(argv)

    def body() -> int:
        if os.geteuid() != 0:
            raise ToolError("runs as root (slurmd starts every task as the job's user); the Slurm image's user is root")
        return node() if args.role == "node" else controller(args.submit)

    return run("slurm_node", body)


if __name__ == "__main__":
    sys.exit(main())
