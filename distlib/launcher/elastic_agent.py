"""The elastic agent: one node's part of an elastic job, round after round.

It does what ``rounds.decide`` says, against the state ``rounds_store.RoundStore`` keeps:

* joins the open round (or waits as a late node), closes it when the rules say so;
* starts this node's workers for the round with torchrun's variables (``RANK``,
  ``WORLD_SIZE``, ..., ``TORCHELASTIC_RESTART_COUNT`` = the round's number, the same everywhere);
* watches them every ``--monitor-interval``: a worker that fails asks for the next round (then
  the others are stopped: SIGTERM, SIGKILL after the grace period, and the failure is
  reported as in a fixed-size run); all of them done marks the node finished;
* watches the others' heartbeats (a thread beats for this node): a node silent for longer than
  the bound is dropped, which restarts a running round;
* a new round (any node's restart) stops this node's workers and joins it; when a round
  closes, every node prints one line: the round, the cause, the new world size;
* SIGTERM/SIGINT/SIGHUP: the workers get the signal (SIGKILL after the grace period) and this
  node leaves the job, which the others see at once (no waiting for its heartbeat to stop);
  the rendezvous is never closed for the others (torch #123678, #67742);
* the job failed (no restarts left, too few nodes within the join timeout): every node stops
  its workers and prints the outcome and every round with its cause; exit status 1;
* the store stopped answering for longer than the heartbeat bound: the workers are stopped and
  the agent fails, naming the store.

Every wait has a deadline: the join timeout, the grace period, the store's patience, the
close timeout for a store this agent hosts.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import time
from typing import List, Mapping, Optional

from ..deadline import Deadline, format_duration
from ..errors import DistError
from ..store.base import Store
from ..store.tcp.connect import format_endpoint
from . import rounds as R
from .agent import STREAM_JOIN_S, Signals, Worker, describe_status, failure_report, say, stop_workers
from .elastic_config import ElasticPlan
from .master import HostedStore, LauncherError, ensure_master_service
from .output import OutputSpec
from .resolve import Resolved
from .rounds_store import Heartbeat, Liveness, RoundStore, StoreGone
from .workerenv import Placement, Program, round_env

log = logging.getLogger("distlib.launcher")

#: How often a waiting agent says what it waits for.
PROGRESS_S = 10.0


class ElasticAgent:
    """One node of an elastic job (module docstring). ``run()`` returns the exit status."""

    def __init__(self, resolved: Resolved, plan: ElasticPlan, program: Program, output: OutputSpec,
                 grace_period: float, rdzv_timeout: float, environ: Mapping[str, str], role: str = "default"):
        self.resolved = resolved
        self.plan = plan
        self.program = program
        self.output = output
        self.grace = grace_period
        self.rdzv_timeout = rdzv_timeout
        self.environ = environ
        self.role = role
        self.run_id = str(resolved.run_id.value)
        self.workers: List[Worker] = []
        self.running_round: Optional[int] = None
        self.hosted: Optional[HostedStore] = None
        self.signals = Signals()
        self.node = ""
        self.info: Optional[R.NodeInfo] = None

    # -- the store ---------------------------------------------------------------------------------

    def _connector(self):
        conf = self.plan.conf
        if self.resolved.rdzv_file is not None:
            from ..store.file import FileStore

            path = str(self.resolved.rdzv_file.value)
            os.makedirs(os.path.dirname(path) or "/", exist_ok=True)

            def connect_file(_seconds: float) -> Store:
                store = FileStore(path)
                store.set_timeout(conf.timeout)
                return store

            return connect_file
        from ..store.tcp.client import TCPStore

        host, port = str(self.resolved.master_addr.value), int(self.resolved.master_port.value)
        self.hosted = ensure_master_service(host, port, self.rdzv_timeout)
        if self.hosted is not None and port == 0:  # --standalone: a private store on a free port
            port = self.hosted.port
            self.resolved = self.resolved.with_master_port(port, "a free port (this agent hosts the store)")
        elif self.hosted is not None:
            log.warning("this agent hosts the rendezvous store at %s in-process: if this node is lost, every node "
                        "fails with it. An elastic job should have a master service of its own (distlib "
                        "store-server) or a file:// endpoint", format_endpoint(host, port))
        return lambda seconds: TCPStore(host, port, None, False, seconds)

    def _identity(self, address: str) -> None:
        host = socket.gethostname()
        self.node = f"{host}-{os.getpid()}-{secrets.token_hex(3)}"
        hint = self.resolved.node_rank.value if self.resolved.node_rank.source != "default" else None
        self.info = R.NodeInfo(host, address, os.getpid(), int(self.resolved.nproc_per_node.value), hint)

    # -- workers ------------------------------------------------------------------------------------------

    def _init_method(self, state: R.JobState) -> Optional[str]:
        if self.resolved.rdzv_file is None:
            return None
        path = str(self.resolved.rdzv_file.value)
        return f"file://{path}.{self.run_id}.attempt_{state.round}"

    def _start(self, state: R.JobState) -> None:
        nproc = self.info.nproc
        first = state.first_rank(self.node)
        node_rank = state.ranks.index(self.node)
        argv = self.program.argv()
        init = self._init_method(state)
        self.workers = []
        for local in range(nproc):
            where = Placement(first + local, local, state.world_size(), node_rank, len(state.ranks), nproc,
                              state.round, state.max_restarts, self.role)
            self.workers.append(Worker(local, first + local, argv, round_env(self.environ, self.resolved, where, init),
                                       self.output, state.round, self.role))
        self.running_round = state.round
        say(R.round_line(state, self.node))
        for w in self.workers:
            try:
                w.start()
            except OSError as exc:
                raise WorkerStartError(f"could not start {w.name}: {' '.join(w.argv)}: {exc}") from exc

    def _stop(self, sig: int = signal.SIGTERM) -> None:
        if self.workers:
            stop_workers(self.workers, sig, self.grace, self.signals)
            deadline = Deadline(STREAM_JOIN_S)
            for w in self.workers:
                w.join_output(deadline)
        self.workers = []
        self.running_round = None

    def _report_failure(self, rounds: RoundStore) -> Optional[Worker]:
        """The worker of this node that exited first with a failure, reported to the job as the
        running round's cause (a restart, or — when another node restarted the round for a
        worker that exited later — the first cause); None when none failed."""
        failed = [w for w in self.workers if w.poll() not in (None, 0) and not w.stopped_by_us]
        if not failed:
            return None
        now = time.time()
        first = min(failed, key=lambda w: (w.exited_at or now, w.global_rank))
        cause = f"worker failed: {first.name} on {self.info.describe()} {describe_status(first.poll())}"
        at, for_round = first.exited_at or now, self.running_round
        rounds.update(lambda s: R.restart(s, for_round, (cause,), at) if s else s)
        return first

    def _check_workers(self, rounds: RoundStore) -> None:
        """One look at the workers: a failure asks for the next round, success finishes the node."""
        codes = [w.poll() for w in self.workers]
        failed = [w for w, c in zip(self.workers, codes) if c not in (None, 0)]
        if failed:
            first = self._report_failure(rounds) or failed[0]
            workers = self.workers
            self._stop()
            for w in failed:
                w.signal(signal.SIGKILL)
            say(failure_report(first, f"node {self.info.describe()}", workers))
        elif codes and all(c == 0 for c in codes):
            for_round = self.running_round
            rounds.update(lambda s: R.finish_node(s, self.node, for_round) if s else s)
            self._stop()
            log.info("this node's workers of round %d finished", for_round)

    # -- the loop -----------------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            return self._run()
        finally:
            if self.hosted is not None:
                self.hosted.stop()

    def _run(self) -> int:
        self.signals.install()
        rounds = heart = None
        try:
            connect = self._connector()
            patience = self.plan.conf.heartbeat_bound
            rounds = RoundStore(connect, self.run_id, patience, self.plan.conf.timeout)
            self._identity(rounds.local_address() or _own_address())
            heart = Heartbeat(RoundStore(connect, self.run_id, patience, self.plan.conf.timeout), self.node,
                              self.plan.conf.keep_alive_interval).start()
            status = self._loop(rounds, heart)
        except StoreGone as exc:
            self._stop(signal.SIGTERM)
            say(f"the elastic job cannot go on: {exc}. Every node loses its rendezvous with it; start the job "
                "again with a new --rdzv-id once the store is back")
            status = 1
        except (WorkerStartError, LauncherError) as exc:
            self._stop(signal.SIGTERM)
            say(str(exc))
            status = 1
        except (DistError, OSError) as exc:
            where = self.resolved.rdzv_file.value if self.resolved.rdzv_file is not None else format_endpoint(
                str(self.resolved.master_addr.value), int(self.resolved.master_port.value))
            how = (f"did not answer within {format_duration(self.plan.conf.timeout)} (--rdzv-conf timeout)"
                   if isinstance(exc, DistError) else "cannot be opened")
            say(f"the rendezvous store at {where} {how}: {exc}")
            status = 1
        except ValueError as exc:  # the state key holds something else
            say(f"the rendezvous store's key for run {self.run_id!r} holds {exc}: another program's key? Give this "
                "run its own --rdzv-id")
            status = 1
        finally:
            if self.workers:
                self._stop(signal.SIGKILL)
            if heart is not None:
                heart.stop()
            if rounds is not None:
                rounds.close()
            self.signals.restore()
        self._release_hosted(status)
        return status

    def _loop(self, rounds: RoundStore, heart: Heartbeat) -> int:
        p = self.plan
        created = rounds.update(lambda s: s or R.initial(p.min_nodes, p.max_nodes, p.max_restarts))
        mismatch = R.config_mismatch(created, p.min_nodes, p.max_nodes, p.max_restarts)
        if mismatch:
            say(f"cannot join run {self.run_id!r} on {rounds.where}: {mismatch}")
            return 1
        if created.phase in (R.SUCCEEDED, R.FAILED) and self.node not in created.nodes:
            say(f"run {self.run_id!r} on {rounds.where} already {created.phase} ({created.outcome}): nothing to do. "
                "Give every new run its own --rdzv-id")
            return 0 if created.phase == R.SUCCEEDED else 1
        log.info("elastic agent %s: run %r, --nnodes %s, --max-restarts %d, store %s, heartbeat bound %s",
                 self.node, self.run_id, p.range_text, p.max_restarts, rounds.where,
                 format_duration(p.conf.heartbeat_bound))
        liveness = Liveness()
        seen_round, opened_at, min_at, waiting_since = -1, 0.0, None, None
        beats_at, said_at = 0.0, 0.0
        while True:
            if self.signals.received:
                return self._leave(rounds, self.signals.received[0])
            if heart.problem:
                raise StoreGone(heart.problem)
            raw, state = rounds.read()
            if state is None:  # the store answers but holds no job: a master service that restarted
                raise StoreGone(f"the rendezvous store ({rounds.where}) answers again but no longer holds run "
                                f"{self.run_id!r}: it restarted and lost the job's state (a master service must "
                                "outlive the job)")
            now = time.monotonic()
            if state.round != seen_round:
                seen_round, opened_at, min_at = state.round, now, None
            if state.phase == R.JOINING and len(state.joined) >= state.min_nodes:
                min_at = now if min_at is None else min_at
            else:
                min_at = None
            if self.node in state.waiting:
                waiting_since = waiting_since if waiting_since is not None else now
            else:
                waiting_since = None
            if now - beats_at >= p.conf.keep_alive_interval / 2:
                nodes = R.watched(state)
                liveness.observe(rounds.beats(nodes), now)
                liveness.forget(nodes)
                beats_at = now
            view = R.View(now=now, silent=liveness.silent(now), heartbeat_bound=p.conf.heartbeat_bound,
                          join_timeout=p.conf.join_timeout, last_call_timeout=p.conf.last_call_timeout,
                          round_opened_at=opened_at, min_reached_at=min_at, waiting_since=waiting_since,
                          running_round=self.running_round)
            action = R.decide(state, self.node, self.info, view)
            if action.kind == "write":
                if rounds.write(raw, action.state):
                    log.info("%s", action.text)
                continue
            if action.kind == "start":
                self._start(state)
            elif action.kind == "keep":
                self._check_workers(rounds)
                time.sleep(p.monitor_interval)
            elif action.kind == "stop":
                self._report_failure(rounds)  # this node's may have exited first
                log.info("stopping this node's workers: %s", action.text)
                self._stop()
            elif action.kind == "rejoin":
                self._stop()
                old = self.node
                self._identity(self.info.addr)
                heart.retarget(self.node)
                say(f"{action.text}; this node ({old}) comes back as a new node ({self.node}) and waits for the "
                    "next round")
            elif action.kind == "finish":
                if action.status and self._report_failure(rounds) is not None:
                    self._stop()  # the failure it reported may be the job's first: read the outcome again
                    continue
                return self._finish(rounds, state, action)
            else:  # wait
                if now - said_at >= PROGRESS_S:
                    log.info("%s", action.text)
                    said_at = now
                time.sleep(p.monitor_interval)

    def _finish(self, rounds: RoundStore, state: R.JobState, action: R.Action) -> int:
        self._stop()
        if action.status:
            say(f"the elastic job failed: {action.text}")
            lines = R.rounds_text(state)
            say("rounds:\n" + "\n".join(f"  {line}" for line in lines))
            return action.status
        log.info("%s", action.text)
        if self.hosted is not None:
            self._wait_for_the_end(rounds)
        return 0

    def _wait_for_the_end(self, rounds: RoundStore) -> None:
        """This agent hosts the store: keep it until the job is over for every node."""
        deadline = Deadline(self.plan.conf.join_timeout)
        while not deadline.expired() and not self.signals.received:
            _raw, state = rounds.read()
            if state is None or state.phase in (R.SUCCEEDED, R.FAILED):
                return
            time.sleep(max(self.plan.monitor_interval, 0.2))

    def _leave(self, rounds: RoundStore, sig: int) -> int:
        name = signal.Signals(sig).name
        say(f"received {name}: stopping this node's workers (SIGKILL after {format_duration(self.grace)}) and "
            "leaving the job; the other nodes go on without it")
        self._stop(sig)
        why = f"node left: {self.info.describe()} received {name}"
        try:
            rounds.update(lambda s: R.drop(s, self.node, why) if s else s)
        except StoreGone as exc:
            log.warning("could not tell the others that this node left (%s): they will notice its silence", exc)
        return 128 + int(sig)

    def _release_hosted(self, status: int) -> None:
        """A store this agent hosts: kept for the others' last calls after a success (run() stops it)."""
        if self.hosted is not None and status == 0:
            self.hosted.linger(self.plan.conf.close_timeout)


class WorkerStartError(RuntimeError):
    """A worker could not be started at all (the message names it)."""


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"
