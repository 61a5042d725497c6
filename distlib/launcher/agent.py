"""The agent: start this node's workers, pass their output through, supervise, stop them.

Design, and why:

* **One process group per worker** (``start_new_session``). A Ctrl-C in a terminal reaches the
  launcher only, which forwards it; stopping a worker signals its whole group, so the
  processes a worker started (data loaders, shells) stop with it. On Linux each worker also
  gets ``PR_SET_PDEATHSIG=SIGKILL``: if the launcher itself is killed with SIGKILL (no chance
  to forward anything), its workers do not live on as orphans.
* **stdout and stderr are piped**: a thread per stream copies it where output.py says (the
  launcher's stream of the same name, each line prefixed with the worker's rank; files for
  ``--redirects``/``--tee``) and keeps the last lines of stderr for the failure report.
* **Supervision** polls every worker every ``POLL_S``. The first worker to exit non-zero (or
  be killed by a signal) fails the node: the others get SIGTERM, then SIGKILL after
  ``grace_period`` seconds, and the launcher exits non-zero with a report naming the global
  and local rank, the exit code or signal, the command and the tail of that worker's stderr.
* **Signals to the launcher** (SIGTERM, SIGINT, SIGHUP) are forwarded to every worker (the
  same signal), followed by SIGKILL after the grace period; a second SIGINT kills at once.
* **Exit status**: 0 when every worker exited 0; else the failed worker's exit code, or
  128 + N when it was killed by signal N (the shell's convention, so ``$?`` and Kubernetes see
  what happened); 128 + N when the launcher itself was stopped by signal N.
* Every wait has a deadline: the grace period, ``STREAM_JOIN_S`` for the output threads,
  ``REAP_S`` after SIGKILL.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..deadline import Deadline, format_duration
from .output import STDERR, STDOUT, OutputSpec, Pump, console_for, read_error_file, write_lines

log = logging.getLogger("distlib.launcher")

POLL_S = 0.05
STREAM_JOIN_S = 5.0
REAP_S = 5.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def say(text: str) -> None:
    """A launcher message on stderr, each line prefixed, never mixed into a worker's line."""
    write_lines(sys.stderr, "".join(f"distlib-run: {line}\n" for line in text.splitlines()).encode("utf-8", "replace"))


def describe_status(code: int) -> str:
    """``exited with code 3`` / ``was killed by signal SIGKILL (9)`` for a Popen returncode."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {name} ({-code})"
    text = f"exited with code {code}"
    if code > 128:
        try:
            text += f" (128+{code - 128}: {signal.Signals(code - 128).name} seen by a shell in between?)"
        except ValueError:
            pass
    return text


def exit_status(code: int) -> int:
    """The launcher's exit status for a worker's Popen returncode."""
    return 128 - code if code < 0 else code


# -- parent-death signal ----------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _child_setup(parent_pid: int):
    """preexec_fn: die with the launcher. Only async-signal-safe work happens in the child."""
    prctl = _PRCTL

    def setup() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent_pid:  # the launcher died before prctl took effect
                os._exit(137)

    return setup


# -- one worker ---------------------------------------------------------------------------------


@dataclass
class Worker:
    local_rank: int
    global_rank: int
    argv: Sequence[str]
    env: Mapping[str, str]
    output: OutputSpec = field(default_factory=OutputSpec)
    #: the restart count its output files are filed under (attempt_<N>)
    attempt: int = 0
    role: str = "default"
    proc: Optional[subprocess.Popen] = None
    pumps: List[Pump] = field(default_factory=list)
    stopped_by_us: Optional[str] = None
    #: when its process exited (wall clock, from its reaper thread; None while it runs): the
    #: elastic agents compare it across nodes to name the worker that failed first
    exited_at: Optional[float] = None

    @property
    def name(self) -> str:
        return f"global rank {self.global_rank} (local rank {self.local_rank})"

    @property
    def tail(self) -> List[str]:
        """The last lines it wrote to stderr."""
        return list(self.pumps[-1].tail) if self.pumps else []

    @property
    def error_file(self) -> Optional[str]:
        return self.output.error_file(self.local_rank, self.attempt)

    def start(self) -> None:
        env = dict(self.env)
        if self.error_file:
            os.makedirs(os.path.dirname(self.error_file), exist_ok=True)
            env["TORCHELASTIC_ERROR_FILE"] = self.error_file
        self.proc = proc = subprocess.Popen(
            list(self.argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=_child_setup(os.getpid()) if _PRCTL else None,
        )
        threading.Thread(target=self._reap, name=f"distlib-run-reap-{self.local_rank}", daemon=True).start()
        prefix = self.output.prefix(self.global_rank, self.local_rank, self.role)
        for stream, pipe in ((STDOUT, proc.stdout), (STDERR, proc.stderr)):
            assert pipe is not None, "stdout and stderr are PIPEs"
            shown, path = self.output.destinations(stream, self.local_rank, self.attempt)
            fd = os.dup(pipe.fileno())
            pipe.close()
            self.pumps.append(Pump(fd, console_for(stream) if shown else None, prefix, path, stream == STDERR,
                                   f"distlib-run-{'out' if stream == STDOUT else 'err'}-{self.local_rank}").start())

    def _reap(self) -> None:
        """Wait for the process and note when it exited (poll() answers None until then)."""
        self.started.wait()
        self.exited_at = time.time()

    @property
    def started(self) -> subprocess.Popen:
        """The worker's process; RuntimeError before start()."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc

    def poll(self) -> Optional[int]:
        return self.proc.poll() if self.proc is not None else None

    def signal(self, sig: int) -> None:
        """Signal the worker's process group (it and what it started)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def join_output(self, deadline: Deadline) -> None:
        for pump in self.pumps:
            pump.join(deadline.remaining())


# -- the node's workers ------------------------------------------------------------------------------


class Signals:
    """Records the signals the launcher receives while its workers run."""

    def __init__(self):
        self.received: List[int] = []
        self._previous: Dict[int, Any] = {}  # what signal.signal returned: a handler, SIG_DFL or SIG_IGN

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in FORWARDED_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except (OSError, ValueError):
                pass

    def _handler(self, signum, _frame) -> None:
        self.received.append(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            try:
                signal.signal(sig, handler)
            except (OSError, ValueError, TypeError):
                pass


def stop_workers(workers: Sequence[Worker], sig: int, grace: float, signals: Optional[Signals] = None) -> None:
    """Send ``sig`` to every running worker, SIGKILL what is left after ``grace`` seconds."""
    alive = [w for w in workers if w.poll() is None]
    for w in alive:
        w.stopped_by_us = signal.Signals(sig).name
        w.signal(sig)
    deadline = Deadline(grace)
    seen = len(signals.received) if signals else 0
    while any(w.poll() is None for w in alive) and not deadline.expired():
        if signals and len(signals.received) > seen and signals.received[-1] == signal.SIGINT:
            break  # a second Ctrl-C: no more waiting
        time.sleep(POLL_S)
    left = [w for w in alive if w.poll() is None]
    if left:
        log.warning("%s still running %s after %s: sending SIGKILL", ", ".join(w.name for w in left),
                    signal.Signals(sig).name, format_duration(deadline.elapsed()))
    # SIGKILL the groups of all stopped workers: also what they started and left behind.
    for w in alive:
        w.signal(signal.SIGKILL)
        if w in left:
            w.stopped_by_us = "SIGKILL"
    reap = Deadline(REAP_S)
    for w in left:
        try:
            w.started.wait(reap.remaining())
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not exit %s after SIGKILL", w.name, w.started.pid, format_duration(REAP_S))


def failure_report(worker: Worker, where: str, others: Sequence[Worker]) -> str:
    """The report of a failed worker: ``where`` names its node (``node 1 of 2``)."""
    code = worker.poll()
    assert code is not None, "a failed worker has exited"
    lines = [f"worker failed: {worker.name} on {where} {describe_status(code)}",
             f"command: {' '.join(worker.argv)} (pid {worker.started.pid})"]
    recorded = read_error_file(worker.error_file)
    if recorded:
        lines.append(f"its error file ({worker.error_file}, written by @record): {recorded}")
    tail = list(worker.tail)
    if tail:
        lines.append(f"last {len(tail)} line(s) of its stderr:")
        lines.extend(f"  | {line}" for line in tail)
    else:
        lines.append("its stderr was empty")
    also = [(w, c) for w in others if w is not worker and (c := w.poll()) is not None and c != 0
            and not w.stopped_by_us]
    if also:
        lines.append("also failed on their own: " + "; ".join(f"{w.name} {describe_status(c)}" for w, c in also))
    stopped = [w for w in others if w.stopped_by_us]
    if stopped:
        lines.append("stopped the other worker(s): " + ", ".join(
            f"{w.name} ({w.stopped_by_us})" for w in stopped))
    return "\n".join(lines)


def run_workers(workers: Sequence[Worker], node_rank: int, nnodes: int, grace: float) -> int:
    """Start ``workers``, supervise them until all are done or one fails; return the exit status."""
    signals = Signals()
    signals.install()
    try:
        started: List[Worker] = []
        try:
            for w in workers:
                w.start()
                started.append(w)
        except OSError as exc:
            say(f"could not start {w.name}: {' '.join(w.argv)}: {exc}")
            stop_workers(started, signal.SIGTERM, grace)
            return 1
        log.debug("started %d worker(s): pids %s", len(started), ", ".join(str(w.started.pid) for w in started))
        status = _supervise(started, node_rank, nnodes, grace, signals)
        out_deadline = Deadline(STREAM_JOIN_S)
        for w in started:
            w.join_output(out_deadline)
        return status
    finally:
        signals.restore()


def _supervise(workers: Sequence[Worker], node_rank: int, nnodes: int, grace: float, signals: Signals) -> int:
    while True:
        if signals.received:
            sig = signals.received[0]
            name = signal.Signals(sig).name
            say(f"received {name}: forwarding it to {sum(w.poll() is None for w in workers)} running worker(s) "
                f"(SIGKILL after {format_duration(grace)})")
            stop_workers(workers, sig, grace, signals)
            return 128 + int(sig)
        codes = [w.poll() for w in workers]
        failed = [w for w, c in zip(workers, codes, strict=True) if c not in (None, 0)]
        if failed:
            first = min(failed, key=lambda w: w.global_rank)
            stop_workers(workers, signal.SIGTERM, grace, signals)
            for w in failed:
                w.signal(signal.SIGKILL)  # what the failed workers started and left behind
            for w in workers:
                w.join_output(Deadline(0.5))
            say(failure_report(first, f"node {node_rank} of {nnodes}", workers))
            code = first.poll()
            assert code is not None, "a failed worker has exited"
            return exit_status(code) or 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)
