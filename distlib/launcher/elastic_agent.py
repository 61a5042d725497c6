"""The elastic agent: one node's part of an elastic job, round after round.

It does what ``rounds.decide`` says, against the state ``rounds_store.RoundStore`` keeps, and
writes nothing ``decide`` did not make: its own events reach ``decide`` through the view that
``bookkeeping.Bookkeeping`` builds (a worker's failure, its workers' success, a signal).

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
* the job failed (no restarts left, too few nodes within the join timeout, a state record that
  no agent wrote): every node stops its workers and prints the outcome and every round with
  its cause; exit status 1;
* the store stops answering (a master service restarting, its host paused): the workers keep
  running, nobody is judged by heartbeats the store could not take, and when it answers again
  within ``--store-outage-timeout`` (60 s) the job goes on in the same round, no restart
  counted; the absence is recorded in the job's state and every node's report lists it. Past
  the bound, the agent says the job cannot go on, naming the store, then stops its workers.

Every wait has a deadline: the join timeout, the grace period, the store's patience, the
close timeout for a store this agent's launch hosts (launch.py hosts it, master.serve).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import replace
from typing import Callable, List, Mapping, Optional

from ..deadline import Deadline, format_duration
from ..errors import DistError
from ..keyspace import KeySpace
from ..store.base import Store
from ..store.tcp.connect import format_endpoint
from . import rounds as R
from .agent import STREAM_JOIN_S, Signals, Worker, describe_status, failure_report, say, stop_workers
from .bookkeeping import Bookkeeping
from .elastic_config import ElasticPlan
from .master import RAN_OUT_SLACK_S, HostedStore, LauncherError
from .output import OutputSpec
from .resolve import Resolved
from .outages import StoreOutages
from .rounds_store import Heartbeat, RoundStore, StoreGone
from .workerenv import Placement, Program, round_env

log = logging.getLogger("distlib.launcher")

#: How often a waiting agent says what it waits for.
PROGRESS_S = 10.0


class ElasticAgent:
    """One node of an elastic job (module docstring). ``run()`` returns the exit status.
    ``hosted``: the store server this node's launch runs in-process, if it does (kept until
    the job is over for every node)."""

    def __init__(self, resolved: Resolved, plan: ElasticPlan, program: Program, output: OutputSpec,
                 grace_period: float, environ: Mapping[str, str], role: str = "default",
                 hosted: Optional[HostedStore] = None):
        self.resolved = resolved
        self.plan = plan
        self.program = program
        self.output = output
        self.grace = grace_period
        self.environ = environ
        self.role = role
        self.hosted = hosted
        self.run_id = str(resolved.run_id.value)
        self.keys = KeySpace(self.run_id)
        self.workers: List[Worker] = []
        self.running_round: Optional[int] = None
        self.signals = Signals()
        self.node = ""
        self.info: Optional[R.NodeInfo] = None
        #: this node's first failed worker of the running round, reported with the next stop
        self.failure: Optional[Worker] = None
        self.leaving: Optional[R.Leaving] = None

    # -- the store ---------------------------------------------------------------------------------

    def _where(self) -> str:
        if self.resolved.rdzv_file is not None:
            return str(self.resolved.rdzv_file.value)
        return format_endpoint(str(self.resolved.master_addr.value), int(self.resolved.master_port.value))

    def _connector(self) -> Callable[[float], Store]:
        conf = self.plan.conf
        if self.resolved.rdzv_file is not None:
            from ..store.file import FileStore

            path = str(self.resolved.rdzv_file.value)
            try:
                os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
            except OSError as exc:
                raise LauncherError(f"the rendezvous store at {path} cannot be opened: {exc}") from exc

            def connect_file(_seconds: float) -> Store:
                store = FileStore(path)
                store.set_timeout(conf.heartbeat_timeout)
                return store

            return connect_file
        from ..store.tcp.client import TCPStore

        host, port = str(self.resolved.master_addr.value), int(self.resolved.master_port.value)

        def connect_tcp(seconds: float) -> Store:
            # connecting: up to ``seconds``; no reconnecting inside the client: the agent rides out
            # the store's absence itself, one account for both its clients (outages.py)
            store = TCPStore(host, port, None, False, seconds, reconnect_timeout=0)
            store.set_timeout(conf.heartbeat_timeout)  # each call: an agent's calls are small
            return store

        return connect_tcp

    def _connect(self, connect: Callable[[float], Store], outages: Optional[StoreOutages] = None) -> RoundStore:
        """A RoundStore of the agent's (``outages``: the account of the store's absences it shares
        with the agent's first one); LauncherError saying how long it tried when the store cannot
        be reached, with the wait that ran out only when it did run out."""
        started = time.monotonic()
        timeout = self.plan.conf.timeout
        try:
            rounds = RoundStore(connect, self.run_id, self.plan.outage_bound, timeout, outages,
                                interrupted=lambda: bool(self.signals.received))
        except (DistError, OSError) as exc:
            waited = time.monotonic() - started
            if isinstance(exc, OSError) and not isinstance(exc, DistError):
                how = "cannot be opened"
            elif waited + RAN_OUT_SLACK_S >= timeout:
                how = f"did not answer within {format_duration(timeout)} (--rdzv-conf timeout)"
            else:
                how = f"refused this agent after {format_duration(waited)}"
            raise LauncherError(f"the rendezvous store at {self._where()} {how}: {exc}") from exc
        if outages is None:
            rounds.outages = StoreOutages(rounds.where, self.plan.outage_bound, self._slow_call(), say)
        return rounds

    def _slow_call(self) -> float:
        """Seconds after which a store call that did answer met a store that was away (a frozen
        master answers late, it does not fail): heartbeat_timeout, at most half the heartbeat
        bound — a longer call delays every node's beats enough to make a live node look lost."""
        conf = self.plan.conf
        return min(conf.heartbeat_timeout, conf.heartbeat_bound / 2)

    def _new_node_id(self, address: str) -> None:
        host = socket.gethostname()
        self.node = f"{host}-{os.getpid()}-{secrets.token_hex(3)}"
        hint = self.resolved.node_rank.value if self.resolved.node_rank.source != "default" else None
        self.info = R.NodeInfo(host, address, os.getpid(), int(self.resolved.nproc_per_node.value), hint)

    # -- workers ------------------------------------------------------------------------------------------

    def _init_method(self, state: R.JobState) -> Optional[str]:
        if self.resolved.rdzv_file is None:
            return None
        return "file://" + self.keys.of_attempt(state.round).file_store(str(self.resolved.rdzv_file.value))

    def _start(self, state: R.JobState) -> None:
        assert self.info is not None
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
        """Stop this node's workers; a failure among them is reported here, once."""
        if self.workers:
            failed = self.failure
            workers = self.workers
            stop_workers(workers, sig, self.grace, self.signals)
            deadline = Deadline(STREAM_JOIN_S)
            for w in workers:
                w.join_output(deadline)
            if failed is not None:
                for w in workers:
                    if w.poll() not in (None, 0) and w.stopped_by_us is None:
                        w.signal(signal.SIGKILL)  # what the worker left behind in its process group
                assert self.info is not None
                say(failure_report(failed, f"node {self.info.describe()}", workers))
        self.workers = []
        self.running_round = None
        self.failure = None

    def _worker_news(self) -> "tuple[Optional[R.WorkerExit], bool]":
        """(this node's first failed worker of the running round, all of them done) for the view."""
        if not self.workers or self.running_round is None:
            return None, False
        codes = [w.poll() for w in self.workers]
        failed = [w for w, c in zip(self.workers, codes, strict=True) if c not in (None, 0) and not w.stopped_by_us]
        if failed:
            now = time.time()
            first = min(failed, key=lambda w: (w.exited_at or now, w.global_rank))
            if self.failure is None or (first.exited_at or now) < (self.failure.exited_at or now):
                self.failure = first
            first, code = self.failure, self.failure.poll()
            assert self.info is not None and code is not None
            cause = f"worker failed: {first.name} on {self.info.describe()} {describe_status(code)}"
            return R.WorkerExit(self.running_round, cause, first.exited_at or now), False
        return None, bool(codes) and all(c == 0 for c in codes)

    # -- the loop -----------------------------------------------------------------------------------------

    def run(self) -> int:
        self.signals.install()
        rounds = heart = None
        try:
            connect = self._connector()
            rounds = self._connect(connect)
            self._new_node_id(rounds.local_address() or _own_address())
            heart = Heartbeat(self._connect(connect, rounds.outages), self.node,
                              self.plan.conf.keep_alive_interval).start()
            status = self._loop(rounds, heart)
        except StoreGone as exc:
            if self.leaving is None and self.signals.received and self.info is not None:
                self._leave(self.signals.received[0])  # a signal while the store was away
            if self.leaving is not None:
                self._stop(signal.SIGTERM)
                log.warning("could not tell the others that this node left (%s): they will notice its silence", exc)
                status = self.leaving.status
            else:  # said before the workers are stopped: the grace period is no part of the bound
                say(f"the elastic job cannot go on: {exc}. Every node loses its rendezvous with it; start the job "
                    "again with a new --rdzv-id once the store is back")
                self._stop(signal.SIGTERM)
                status = 1
        except (WorkerStartError, LauncherError) as exc:
            self._stop(signal.SIGTERM)
            say(str(exc))
            status = 1
        except (DistError, OSError) as exc:  # a store call outside RoundStore's retries: say which, no traceback
            self._stop(signal.SIGTERM)
            say(f"the rendezvous store at {self._where()} failed: {exc}")
            status = 1
        finally:
            if self.workers:
                self._stop(signal.SIGKILL)
            if heart is not None:
                heart.stop()
            if rounds is not None:
                rounds.close()
            self.signals.restore()
        return status

    def _loop(self, rounds: RoundStore, heart: Heartbeat) -> int:
        assert self.info is not None
        books = Bookkeeping(self.plan)
        seen_state = wrote = False
        said_at = 0.0
        #: absences of the store this agent rode out, not yet seen recorded in the state
        away: List[R.Outage] = []
        while True:
            if self.signals.received and self.leaving is None:
                self._leave(self.signals.received[0])
            if heart.problem:
                raise StoreGone(heart.problem)
            raw, state = rounds.read()
            now = time.monotonic()
            if isinstance(state, R.JobState):
                if not seen_state:
                    refusal = None if wrote else self._refusal(state, rounds.where)
                    if refusal is not None:
                        return refusal
                    self._started(rounds)
                seen_state = True
                now = self._settle_absences(rounds, books, state, away, now)
                books.observe(state, self.node, now)
                if books.beats_due(now):
                    watched = R.watched(state)
                    counters = rounds.beats(watched)
                    now = self._settle_absences(rounds, books, state, away, now)
                    books.observe_beats(counters, watched, now)
                away[:] = [o for o in away if not R.outage_noted(state, o)]
            elif state is None and seen_state:  # the store answers but holds no job any more
                raise StoreGone(f"the rendezvous store ({rounds.where}) answers again but no longer holds run "
                                f"{self.run_id!r} (its key {self.keys.elastic_state()} is gone): it restarted and lost "
                                "the job's state (a master service must outlive the job), or something deleted the key")
            failure, finished = self._worker_news()
            view = replace(books.view(now, self.running_round, failure, finished, self.leaving),
                           outage=away[0] if away else None)
            action = R.decide(state, self.node, self.info, view)
            if action.kind is R.Kind.WRITE:
                assert action.state is not None
                if rounds.write(raw, action.state):
                    wrote = True
                    log.info("%s", action.text)
                continue
            if action.kind is R.Kind.LEAVE:
                return action.status
            if action.kind is R.Kind.START:
                assert isinstance(state, R.JobState)
                self._start(state)
            elif action.kind is R.Kind.KEEP:
                time.sleep(self.plan.monitor_interval)
            elif action.kind is R.Kind.STOP:
                log.info("stopping this node's workers: %s", action.text)
                self._stop()
            elif action.kind is R.Kind.REJOIN:
                self._stop()
                old = self.node
                self._new_node_id(self.info.addr)
                heart.retarget(self.node)
                say(f"{action.text}; this node ({old}) comes back as a new node ({self.node}) and waits for the "
                    "next round")
            elif action.kind is R.Kind.FINISH:
                assert isinstance(state, R.JobState)
                return self._finish(rounds, state, action)
            else:  # wait
                if now - said_at >= PROGRESS_S:
                    log.info("%s", action.text)
                    said_at = now
                time.sleep(self.plan.monitor_interval)

    def _settle_absences(self, rounds: RoundStore, books: Bookkeeping, state: R.JobState, away: List[R.Outage],
                         now: float) -> float:
        """The store's absences that ended since the last look: none of their time counts for this
        agent's clocks, and each is to be recorded in the job's state (for every node's report).
        Returns the time now (a call that met an absence returned late)."""
        ended = rounds.outages.take_ended()
        if not ended:
            return now
        now = time.monotonic()
        for absence in ended:
            books.store_was_away(absence.seconds, now)
            away.append(R.Outage(state.round, absence.started, absence.seconds))
        return now

    def _refusal(self, state: R.JobState, where: str) -> Optional[int]:
        """The exit status when this node cannot join the job it found (other limits, or a job
        that already ended), having said why; None when it can."""
        p = self.plan
        mismatch = R.config_mismatch(state, p.min_nodes, p.max_nodes, p.max_restarts)
        if mismatch:
            say(f"cannot join run {self.run_id!r} on {where}: {mismatch}")
            return 1
        if state.phase in (R.SUCCEEDED, R.FAILED) and self.node not in state.nodes:
            say(f"run {self.run_id!r} on {where} already {state.phase} ({state.outcome}): nothing to do. "
                "Give every new run its own --rdzv-id")
            return 0 if state.phase == R.SUCCEEDED else 1
        return None

    def _started(self, rounds: RoundStore) -> None:
        p = self.plan
        log.info("elastic agent %s: run %r, --nnodes %s, --max-restarts %d, store %s, heartbeat bound %s",
                 self.node, self.run_id, p.range_text, p.max_restarts, rounds.where,
                 format_duration(p.conf.heartbeat_bound))

    def _finish(self, rounds: RoundStore, state: R.JobState, action: R.Action) -> int:
        self._stop()
        for outage in state.outages:  # on every node, whatever the outcome: a person reads one log
            say(f"the rendezvous store ({rounds.where}) {R.outage_text(outage)}")
        if action.status:
            say(f"the elastic job failed: {action.text}")
            lines = R.rounds_text(state)
            if lines:
                say("rounds:\n" + "\n".join(f"  {line}" for line in lines))
            return action.status
        log.info("%s", action.text)
        if self.hosted is not None:
            self._wait_for_the_end(rounds)
        return 0

    def _wait_for_the_end(self, rounds: RoundStore) -> None:
        """This node's launch hosts the store: keep it until the job is over for every node."""
        deadline = Deadline(self.plan.conf.join_timeout)
        while not deadline.expired() and not self.signals.received:
            _raw, state = rounds.read()
            if not isinstance(state, R.JobState) or state.phase in (R.SUCCEEDED, R.FAILED):
                return
            time.sleep(max(self.plan.monitor_interval, 0.2))

    def _leave(self, sig: int) -> None:
        """A signal: this node's workers get it (SIGKILL after the grace period), and the view
        says this node leaves, so that decide writes its drop."""
        name = signal.Signals(sig).name
        say(f"received {name}: stopping this node's workers (SIGKILL after {format_duration(self.grace)}) and "
            "leaving the job; the other nodes go on without it")
        self._stop(sig)
        assert self.info is not None
        self.leaving = R.Leaving(f"node left: {self.info.describe()} received {name}", 128 + int(sig))


class WorkerStartError(RuntimeError):
    """A worker could not be started at all (the message names it)."""


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"
