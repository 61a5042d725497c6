"""``distlib cluster up|down|logs|ps|report|config``: what `make cluster-up`, `make
cluster-down` and `make cluster-logs` run (docs/cluster.md).

``up`` builds the image (unless SKIP_BUILD), removes the previous run of this checkout, starts
a new Compose project with a new run id, streams the workers' logs (unless QUIET), waits for
every worker (at most CLUSTER_TIMEOUT), names the failed containers root cause first, prints
rank 0's report, and exits with the job's status.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from distlib import command
from ..jobs import mpi_rank
from distlib.command import ToolError
from . import auth_token, elastic, engine, gpus, master, outcome, slurm, ssh_keys, stall, state
from .config import LABEL, OWNER_LABEL, Settings, find_root, new_run_id, project_name

PROG = "distlib cluster"
#: Seconds the engine gives a container between SIGTERM and SIGKILL when the cluster stops it.
STOP_GRACE_S = 5
#: How often `up` looks at the workers while the job runs.
POLL_S = 0.25
#: The line that starts rank 0's report: `up` prints the report once, at the end.
REPORT_START = "distlib train_dp report"
NFS_NO_CLIENT = re.compile(r"failed to mount local volume.*no such device")
BUILD_TIMEOUT_S = 1800


def say(text: str) -> None:
    print(f"cluster: {text}", file=sys.stderr, flush=True)


def _compose_env(variables: Dict[str, str]) -> Dict[str, str]:
    return {**os.environ, **variables}


def _tail(path: Path, lines: int) -> List[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


# -- up -----------------------------------------------------------------------------------------


def _build_images(cfg: Settings, client) -> None:
    import docker

    if cfg.skip_build:
        try:
            client.images.get(cfg.image)
        except docker.errors.ImageNotFound:
            raise ToolError(f"SKIP_BUILD=1 but image {cfg.image} does not exist (make image builds it)") from None
    else:
        try:
            client.images.get(cfg.image)
            say(f"checking that {cfg.image} holds this working tree (docker/build-image.sh; seconds when it does)")
        except docker.errors.ImageNotFound:
            say(f"image {cfg.image} not found: building it with docker/build-image.sh (offline; minutes the first time)")
        script = slurm.BUILD_SCRIPT if cfg.mode == "slurm" else Path("docker") / "build-image.sh"
        _run_script(cfg, cfg.root / script, "build-image.log", f"building {cfg.image}",
                    {"TARGET": "cuda"} if cfg.gpu else {})
    if cfg.mode == "nfs":
        _run_script(cfg, cfg.root / "compose" / "nfs" / "build-nfs-image.sh", "build-nfs-image.log",
                    "building the NFS server image")


def _run_script(cfg: Settings, script: Path, log_name: str, what: str, more_env: Optional[Dict[str, str]] = None) -> None:
    log = cfg.state_dir / log_name
    env = {**os.environ, "IMAGE": cfg.image, **(more_env or {})}
    with open(log, "w") as out:
        try:
            done = subprocess.run(["bash", str(script)], cwd=cfg.root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ToolError(f"{what} ran past {BUILD_TIMEOUT_S} s (log: {log})") from None
    if done.returncode != 0:
        for line in _tail(log, 20):
            print(line, file=sys.stderr)
        raise ToolError(f"{what} failed (log: {log})")


class _LogPrinter:
    """Prints the workers' log lines indented on stderr, without rank 0's report (printed once
    at the end)."""

    def __init__(self):
        self.hidden: set = set()

    def __call__(self, container, line: str) -> None:
        if container.id in self.hidden:
            return
        if REPORT_START in line:
            self.hidden.add(container.id)
            if len(self.hidden) == 1:
                print("  (the report follows below)", file=sys.stderr, flush=True)
            return
        print(f"  {engine.short_name(container)}  | {line}", file=sys.stderr, flush=True)


def _wait_for(workers: List[Any], timeout_s: float) -> bool:
    """Wait until every worker has exited; False when ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    pending = list(workers)
    while pending:
        for container in list(pending):
            container.reload()
            if container.status in ("exited", "dead"):
                pending.remove(container)
        if not pending:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _stop(containers: List[Any]) -> None:
    import docker

    for container in containers:
        try:
            container.reload()
            if container.status == "running":
                container.stop(timeout=STOP_GRACE_S)
        except docker.errors.NotFound:
            pass


def _save_report(run_dir: Path, workers: List[Any]) -> Optional[str]:
    """Copy report.txt and report.json out of the reports volume (every worker mounts it at
    /workspace) into the run's directory; the text, or None when rank 0 wrote none."""
    for name in ("report.txt", "report.json"):
        (run_dir / name).unlink(missing_ok=True)
    for container in workers[:1]:
        text = engine.read_file(container, "/workspace/report.txt")
        if not text:
            return None
        (run_dir / "report.txt").write_bytes(text)
        data = engine.read_file(container, "/workspace/report.json")
        if data:
            (run_dir / "report.json").write_bytes(data)
        return text.decode("utf-8", "replace")
    return None


def _check_gpus(cfg: Settings, client) -> None:
    """GPU=1, after the build: a probe container with the workers' GPU request must see enough
    GPUs, and run a kernel and NCCL on them (gpus.py)."""
    say(f"GPU=1: asking a container of {cfg.image} with the workers' GPU request what it sees "
        "(distlib gpu-info --check)")
    facts = gpus.probe(client, cfg.image, {LABEL: "1", OWNER_LABEL: cfg.owner})
    found = gpus.require(facts, cfg.image, cfg.nodes, cfg.nproc_per_node)
    say(f"GPU=1: {found} GPU(s), cupy {facts.get('cupy')}, NCCL {facts.get('nccl')}, CUDA driver "
        f"{facts.get('driver')}; worker k takes GPUs k*{cfg.nproc_per_node}.. (CUDA_VISIBLE_DEVICES)")


def up(cfg: Settings) -> int:
    client = engine.connect()
    if cfg.gpu:  # before anything is removed, built or created
        problem = gpus.engine_gpu_problem(client.info(), os.environ.get("DOCKER_HOST") or "the default socket")
        if problem:
            raise ToolError(problem)
    compose = engine.find_compose(cfg.compose or None)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    if state.load(cfg.state_dir):
        say("removing the previous run first (make cluster-down does this too)")
        down(cfg, quiet_if_none=True)
    _build_images(cfg, client)
    if cfg.gpu:
        _check_gpus(cfg, client)
    started = time.monotonic()
    run, workers = _start(cfg, client, compose)
    watch = master.MasterWatch(master.find(client, run.project)).start() if cfg.mode == "tcp" else None
    # Whose exit ends the job: the workers, or in MODE=mpi the launcher (its mpirun), after which
    # the workers (sshd only) are stopped.
    job = engine.project_containers(client, run.project, "launcher") if cfg.mode == "mpi" else \
        engine.project_containers(client, run.project, slurm.CONTROLLER) if cfg.mode == "slurm" else workers

    follower = None if cfg.quiet else engine.LogFollower(job + [w for w in workers if w not in job], _LogPrinter())
    try:
        finished = _wait_for(job, cfg.timeout_s)
    except KeyboardInterrupt:
        if follower:
            follower.stop(grace=0)
        say("interrupted: the cluster is left as it is (make cluster-logs, make cluster-down)")
        return 130
    if follower:
        follower.stop(grace=1.0)  # the last lines
    for away in watch.stop() if watch else ():
        say(f"the master service was {away.words()}")
    status, held, stopped = 0, [], set()
    if not finished:
        say(f"the job ran past CLUSTER_TIMEOUT={cfg.timeout_s:g}s: stopping the " +
            {"mpi": "launcher", "slurm": "controller"}.get(cfg.mode, "workers"))
        # what held the job, read before they are stopped
        held = stall.held_by({engine.short_name(c): engine.logs_text(c) for c in job + workers})
        stopped = {c.name for c in job if not _exited(c)}  # their 143 is the cluster's SIGTERM, no failure
        _stop(job)
        status = 124
    # Workers that ended before the job did died on their own (MODE=mpi: a worker's sshd and its
    # ranks went away); those still running are stopped now, and their status says nothing.
    ended_early = [w for w in workers if w not in job and _exited(w)]
    _stop([c for c in engine.project_containers(client, run.project) if c not in job])  # master, nfs, mpi workers
    judged = [c for c in job + ended_early if c.name not in stopped]
    if cfg.elastic:  # the rounds; a worker the job declared lost is not its failure
        judged = elastic.conclude(engine.project_containers(client, run.project, "worker"), judged)
    return _conclude(cfg, run, workers, judged, status, time.monotonic() - started, held)


def _exited(container) -> bool:
    container.reload()
    return container.status in ("exited", "dead")


def _start(cfg: Settings, client, compose: engine.Compose):
    """A new run id and Compose project, recorded, then `compose up`; (the run, its workers)."""
    run_id = cfg.run_id or new_run_id()
    project = project_name(run_id)
    run = state.Run(project=project, run_id=run_id, mode=cfg.mode, nodes=cfg.nodes, image=cfg.image,
                    files=cfg.compose_files(), compose=list(compose.argv), variables=cfg.compose_variables(run_id),
                    job=cfg.job, auth=cfg.auth)
    run_dir = state.save(cfg.state_dir, run)
    if cfg.auth:  # this run's token: the master, every rank and every store require it
        token = auth_token.make(cfg.auth_dir(run_id))
        say(f"auth on: made this run's token in {token.path} (mode {token.mode:o}); "
            f"{_AUTH_HOLDERS[cfg.mode]} read it from {auth_token.CONTAINER_PATH} (DISTLIB_AUTH_TOKEN_FILE); "
            "make cluster-down deletes it; AUTH=0 runs without one")
    else:
        say("auth OFF (AUTH=0): the store and the ranks' listeners admit anyone on the cluster network "
            "(torch clients too)")
    if cfg.mode == "mpi":  # this run's key pair: mpirun in the launcher logs in to the workers with it
        keys = ssh_keys.make(cfg.ssh_dir(run_id), f"mpirun@{project}", client, cfg.image)
        say(f"made this run's SSH key pair in {keys.directory} (the launcher gets the private key, the workers "
            "the public one; make cluster-down deletes it)")
    if cfg.mode == "slurm":  # this cluster's munge key: slurmctld and every slurmd authenticate with it
        say(f"made this cluster's munge key in {slurm.make_key(slurm.key_dir(run_dir))} (make cluster-down deletes it)")
    job = f"JOB {cfg.job!r} in {cfg.job_dir}" if cfg.job else f"job {cfg.job_module}"
    per = "process(es), one GPU each" if cfg.gpu else "process(es)"
    say(f"run {run_id}: {cfg.nodes} worker container(s) x {cfg.nproc_per_node} {per}, mode {cfg.mode}, "
        f"{job}, image {cfg.image}, {compose.text} {compose.version} (project {project})")
    started = time.monotonic()
    up_log = run_dir / "compose-up.log"
    done = engine.run_compose(compose, project, run.files, ["up", "-d", "--no-build", "--scale", f"worker={cfg.nodes}"],
                              _compose_env(run.variables), log_path=str(up_log), timeout=cfg.timeout_s)
    if done.returncode != 0:
        for line in _tail(up_log, 15):
            print(f"cluster:   | {line}", file=sys.stderr)
        if NFS_NO_CLIENT.search(up_log.read_text(errors="replace")):
            raise ToolError("the Docker host's kernel cannot mount NFS (mount(2) of the NFS volume failed with "
                            "ENODEV, \"no such device\": no nfs/nfs4 file system in this kernel; load it with "
                            "`modprobe nfs` where the kernel has the module). Use MODE=file for a local shared "
                            "volume; make cluster-down removes what was created")
        raise ToolError(f"starting the cluster failed ({compose.text} up; log: {up_log}); make cluster-down "
                        "removes what was created")
    workers = engine.project_containers(client, project, "worker")
    if len(workers) != cfg.nodes:
        raise ToolError(f"expected {cfg.nodes} worker containers, Compose started {len(workers)} (see {up_log})")
    say(f"{cfg.nodes} workers started in {time.monotonic() - started:.0f} s; the job is running "
        "(logs: make cluster-logs)")
    return run, workers


#: Who gets the token, by mode (the Compose files auth*.yml).
_AUTH_HOLDERS = {
    "tcp": "the master service and every worker",
    "rank0": "every worker (rank 0's store and the ranks' listeners)",
    "file": "every worker (the FileStore has no network: the token protects the ranks' listeners)",
    "nfs": "every worker (the FileStore has no network: the token protects the ranks' listeners)",
    "mpi": "the launcher and every worker (mpirun passes DISTLIB_AUTH_TOKEN_FILE on to the ranks)",
    "slurm": "slurmctld and every worker (sbatch passes DISTLIB_AUTH_TOKEN_FILE on to the tasks)",
}


def _conclude(cfg: Settings, run: state.Run, workers: List[Any], judged: List[Any], status: int,
              elapsed: float, held: Sequence[str] = ()) -> int:
    """The report, the failures root cause first, and the exit status (the root cause's, unless
    the run timed out). ``judged``: the containers whose exit status counts (the workers, or the
    launcher and the workers that ended on their own; not those CLUSTER_TIMEOUT stopped);
    ``held``: what held a job that ran past CLUSTER_TIMEOUT (stall.py)."""
    for container in judged:
        container.reload()
    failures = outcome.failed_root_cause_first(
        (c.name, c.attrs["State"], engine.logs_text(c) if c.attrs["State"].get("ExitCode") else "") for c in judged)
    if failures and status == 0:
        status = failures[0].status
    run_dir = run.directory(cfg.state_dir)
    report = _save_report(run_dir, workers)
    if report:
        print(f"\n{report.rstrip()}\n", flush=True)
    elif cfg.job:
        say("your job wrote no report (one that writes /workspace/report.txt, and report.json, gets it printed "
            "and kept here); its output: make cluster-logs")
    else:
        say("no report was written (rank 0 did not get that far)")
    for line in held:
        say(f"HELD: {line}")
    blamed = _mpi_blame(workers, failures) if cfg.mode == "mpi" else \
        slurm.blame(next((f.log for f in failures if f.name.endswith(slurm.CONTROLLER_SUFFIXES)), "")) \
        if cfg.mode == "slurm" else None
    if blamed:
        say(f"FAILED: {blamed} (the first failure)")
    for i, failure in enumerate(failures):
        say(f"FAILED: {failure.name} exited with {failure.status}" + (" (the first failure)" if i == 0 and not blamed
                                                                       else ""))
    for failure in failures:
        say(f"{failure.name}:")
        lines = outcome.mpirun_lines(failure.log) if failure.name.endswith(_LAUNCHER_SUFFIXES) else \
            outcome.telling_lines(failure.log)
        for line in lines:
            print(f"cluster:   | {line}", file=sys.stderr)
    if status:
        say(f"job FAILED in {elapsed:.0f} s (exit status {status}; {_auth_words(cfg.auth)}); all logs: "
            "make cluster-logs; remove: make cluster-down")
        return status
    where = f"report: {run_dir}/report.txt and report.json; " if report else ""
    say(f"job succeeded in {elapsed:.0f} s ({_auth_words(cfg.auth)}); {where}remove: make cluster-down")
    return 0


def _auth_words(auth: bool) -> str:
    return "auth on: every connection authenticated with the run's token" if auth else "auth off (AUTH=0)"


#: The launcher container's name ends so under Compose v2 and v1.
_LAUNCHER_SUFFIXES = ("-launcher-1", "_launcher_1")


def _mpi_blame(workers: List[Any], failures: List[outcome.Failure]) -> Optional[str]:
    """MODE=mpi: the failing rank and the worker container it ran in, in words. In order: the
    rank distlib's watchdog found missing (a stalled rank: the others waited for it), else the
    first rank to end abnormally by the ranks' own records in the workers (mpi_rank: mpirun
    tends to blame the peer that noticed a death first), else the rank mpirun names."""
    launcher = next((f for f in failures if f.name.endswith(_LAUNCHER_SUFFIXES)), None)
    if launcher is None or failures[0] is not launcher:  # a worker container died: that is the cause
        return None
    blamed = outcome.mpi_failed_rank(launcher.log)
    if blamed is not None and blamed.stalled:
        return f"rank {blamed.rank} on {_worker_of(workers, blamed.rank, launcher.log)}: {blamed.what}"
    records = []
    for worker in workers:
        for data in engine.read_dir(worker, mpi_rank.RECORD_DIR).values():
            try:
                records.append(dict(json.loads(data), worker=worker))
            except ValueError:
                continue
    first = outcome.first_abnormal_end(records)
    if first is not None:
        worker = first["worker"]
        node = outcome.mpi_node_of(first["rank"], launcher.log) if first["rank"] is not None else None
        where = f"{engine.short_name(worker)} ({worker.name}" + (f", {node[0]})" if node else ")")
        said = f"; mpirun named rank {blamed.rank}, which {blamed.what}" if blamed and blamed.rank != first["rank"] \
            else ""
        return f"rank {first['rank']} on {where}: {first['what']}, the first rank to end by the ranks' own records{said}"
    if blamed is not None:
        return f"rank {blamed.rank} on {_worker_of(workers, blamed.rank, launcher.log)}: {blamed.what}, as mpirun " \
               "reported"
    return None


def _worker_of(workers: List[Any], rank: int, launcher_log: str) -> str:
    """The worker that ran ``rank`` (the launcher's plan in its log: address and container name),
    in words."""
    node = outcome.mpi_node_of(rank, launcher_log)
    if node is None:
        return "a worker"
    address, name = node
    container = next((w for w in workers if w.name == name), None)
    return f"{engine.short_name(container)} ({name}, {address})" if container else f"{name} ({address})"


# -- down ---------------------------------------------------------------------------------------


def down(cfg: Settings, quiet_if_none: bool = False) -> int:
    client = engine.connect()
    run = state.load(cfg.state_dir)
    found, problems = False, []
    if run is not None:
        found = True
        compose = engine.Compose(tuple(run.compose), "")
        run_dir = run.directory(cfg.state_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        log = run_dir / "compose-down.log"
        try:
            done = engine.run_compose(compose, run.project, run.files, ["down", "-v", "--remove-orphans", "-t", "5"],
                                      _compose_env(run.variables), log_path=str(log), timeout=300)
            if done.returncode != 0:
                say(f"compose down reported a problem (see {log}); removing by label")
        except (OSError, ToolError) as exc:
            say(f"compose down failed ({exc}); removing by label")
        problems += engine.remove_by_label(client, f"com.docker.compose.project={run.project}")
        if not problems:
            say(f"removed {run.project} (containers, network, volumes)")
        state.clear(cfg.state_dir)
    for keys in cfg.state_dir.glob("*/ssh"):  # MODE=mpi key pairs: their containers are gone
        ssh_keys.remove(keys)
    for token in cfg.state_dir.glob("*/auth"):  # the runs' tokens, likewise
        auth_token.remove(token)
    slurm.remove_keys(cfg.state_dir)  # MODE=slurm munge keys, likewise
    owner = f"{OWNER_LABEL}={cfg.owner}"
    left = engine.labelled(client, owner)
    if any(left.values()):  # what a killed `up` or a lost record left behind
        found = True
        more = engine.remove_by_label(client, owner)
        problems += more
        if not more:
            say("removed leftovers of earlier runs")
    for problem in problems:
        say(problem)
    if not found and not quiet_if_none:
        say("nothing to remove: no cluster was started from here")
    return 1 if problems else 0


def kill(cfg: Settings, node: str) -> int:
    """`make cluster-kill NODE=2` (a worker: elastic.kill) or NODE=master (the master service,
    restarted by Compose: master.kill)."""
    if node.strip() != master.SERVICE:
        return elastic.kill(cfg.state_dir, node)
    run = state.load(cfg.state_dir)
    if run is None:
        raise ToolError(f"no cluster run recorded in {cfg.state_dir} (make cluster-up starts one)")
    say(master.kill(engine.connect(), run.project))
    return 0


# -- logs, ps, report, config -------------------------------------------------------------------


def _last_run(cfg: Settings) -> state.Run:
    run = state.load(cfg.state_dir)
    if run is None:
        raise ToolError(f"no cluster run recorded in {cfg.state_dir} (make cluster-up starts one)")
    return run


def logs(cfg: Settings) -> int:
    run = _last_run(cfg)
    client = engine.connect()
    containers = engine.project_containers(client, run.project)
    if not containers:
        raise ToolError(f"{run.project} has no containers (removed? make cluster-up starts a new run)")
    say(f"following the logs of {run.project} (mode {run.mode}; Ctrl-C stops following, the cluster is not touched)")
    width = max(len(engine.short_name(c)) for c in containers)

    def emit(container, line: str) -> None:
        print(f"{engine.short_name(container):<{width}}  | {line}", flush=True)

    follower = engine.LogFollower(containers, emit)
    try:
        while follower.running():
            follower.join(0.5)
    except KeyboardInterrupt:
        follower.stop(grace=0)
        return 130
    return 0


def ps(cfg: Settings) -> int:
    run = _last_run(cfg)
    client = engine.connect()
    from ..jobs._common import table

    rows = []
    for c in engine.project_containers(client, run.project):
        st = c.attrs["State"]
        rows.append([c.name, c.labels.get("com.docker.compose.service", "?"), st.get("Status", "?"),
                     st.get("ExitCode", "") if st.get("Status") in ("exited", "dead") else "",
                     (st.get("FinishedAt") or "")[:19] if st.get("Status") == "exited" else ""])
    print(f"{run.project} (mode {run.mode}, run {run.run_id})")
    print(table(["container", "service", "state", "exit", "finished (UTC)"], rows) if rows else "(no containers)")
    return 0


def report(cfg: Settings, as_json: bool) -> int:
    run = _last_run(cfg)
    path = run.directory(cfg.state_dir) / ("report.json" if as_json else "report.txt")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ToolError(f"run {run.run_id} wrote no report ({path})") from None
    sys.stdout.write(text)
    return 0


def config(cfg: Settings) -> int:
    compose = engine.find_compose(cfg.compose or None)
    done = engine.run_compose(compose, "distlib-config", cfg.compose_files(), ["config"],
                              _compose_env(cfg.compose_variables(cfg.run_id or "config")))
    return done.returncode


# -- the command --------------------------------------------------------------------------------


VARIABLES = """\
environment (the Makefile's variables):
  MODE            tcp (default) | rank0 | file | nfs | mpi | slurm: how the ranks meet (docs/cluster.md);
                  mpi: mpirun in a launcher container, over SSH into the workers; slurm: a real Slurm
                  cluster (slurmctld + slurmd workers, image distlib:slurm), the job by sbatch/srun
  NODES           worker containers (default 4), each its own host
  NPROC_PER_NODE  processes per worker container (default 1; with GPU=1 one GPU each)
  AUTH            1 (default): a new random token per run; the master service, rank 0's store and every
                  rank's listeners admit only holders of it (a read-only file in each container,
                  DISTLIB_AUTH_TOKEN_FILE). 0: no token, so that torch processes can join the store
  GPU             1: the workers on NVIDIA GPUs (NCCL for cupy arrays, gloo for numpy ones); needs the
                  NVIDIA Container Toolkit on the Docker host; image distlib:cuda (make image-gpu)
  IMAGE           image to run (default distlib:cpu, with GPU=1 distlib:cuda); built or updated by
                  docker/build-image.sh
  SKIP_BUILD      1: use IMAGE as it is
  JOB             your own job on every worker, e.g. "python my_train.py --epochs 3" (script.py args,
                  or -m module args); JOB_DIR (default: the current directory) is mounted read-only
                  as its working directory. Default: JOB_MODULE (distlib_deploy.jobs.train_dp)
  JOB_ARGS        extra arguments of the job
  NFS_SERVER, NFS_PATH  MODE=file: the shared volume is this NFS export (NFS_VERSION, NFS_OPTIONS)
  COMPOSE         the Compose command (default: `docker compose`, else docker-compose)
  CLUSTER_TIMEOUT seconds the job may run before it is stopped (default 900)
  CLUSTER_STATE_DIR  where runs are recorded (default .build/cluster)
  QUIET           1: do not stream the workers' logs while the job runs
  RUN_ID          the run's id (default: a new one per run)
  MIN_NODES, MAX_RESTARTS  an elastic job (MODE=tcp|file|nfs): --nnodes MIN_NODES:NODES --max-restarts N;
                  `make cluster-kill NODE=2` (distlib cluster kill) kills worker-2 mid-run
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                     epilog=VARIABLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_log_level(parser)
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("up", help="build the image, run the job on a new cluster, print its report; exit status = the job's")
    sub.add_parser("down", help="remove every container, network and volume this checkout's runs created")
    sub.add_parser("logs", help="follow the logs of the last run (Ctrl-C stops following)")
    sub.add_parser("ps", help="the last run's containers")
    rep = sub.add_parser("report", help="print the last run's report again")
    rep.add_argument("--json", action="store_true", help="print report.json instead of the text")
    sub.add_parser("config", help="print the merged Compose file `up` would use for MODE")
    sub.add_parser("kill", help="SIGKILL worker NODE (environment; worker-2 is NODE=2) of the last run: a lost node")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if "log_level" in args:
        command.setup_logging(args.log_level)

    def body() -> int:
        cfg = Settings.from_env(find_root())
        if args.action == "up":
            return up(cfg)
        if args.action == "down":
            return down(cfg)
        if args.action == "logs":
            return logs(cfg)
        if args.action == "ps":
            return ps(cfg)
        if args.action == "report":
            return report(cfg, as_json=args.json)
        if args.action == "kill":
            return kill(cfg, os.environ.get("NODE", ""))
        return config(cfg)

    return command.run("cluster", body)
