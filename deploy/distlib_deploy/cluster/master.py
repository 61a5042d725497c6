"""The master service of a Compose cluster run (MODE=tcp): killing it mid-job (``make
cluster-kill NODE=master``) and watching it come back, for the run's report.

compose/mode-tcp.yml runs it with ``restart: on-failure``: a master that dies is started again
by Docker (its healthcheck, ``distlib store-server --ping``, passes once it accepts clients). ``kill`` kills the store server *inside* the container, as an
OOM kill or a crash would: ``docker kill`` would count as stopping it by hand, and Docker does
not restart a container stopped by hand. ``MasterWatch`` notes, from the engine's side, each
time the master was away — from its exit to its healthcheck passing again — so that ``up``
can say it however the job noticed (an elastic job's agents say it too, in the rounds).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, List, Optional

from distlib.command import ToolError
from . import engine, outcome

SERVICE = "master"
#: How often the watch looks at the master container (its healthcheck runs every 2 s).
POLL_S = 0.5


def find(client, project: str) -> Any:
    """The run's master container; ToolError when the run has none (a mode without one)."""
    found = engine.project_containers(client, project, SERVICE)
    if not found:
        raise ToolError("this run has no master service (only MODE=tcp has one): nothing to kill")
    return found[0]


def kill(client, project: str) -> str:
    """SIGKILL the store server in the master container (module docstring); what was done, in words."""
    master = find(client, project)
    master.reload()
    if master.status != "running":
        raise ToolError(f"the master service ({master.name}) is not running ({master.status})")
    # every process of the container's user but its init (docker-init, PID 1) and this shell:
    # the store server; its init then exits with 137, and the restart policy starts it again
    code, output = master.exec_run(["sh", "-c", "kill -KILL -1"], stdout=True, stderr=True)
    if code not in (0, None, 137, -9):
        text = (output or b"").decode("utf-8", "replace").strip()
        raise ToolError(f"could not kill the store server in {master.name}: exit {code}: {text}")
    return (f"killed the master service's store server in {master.name} with SIGKILL: Compose starts it again "
            "(restart: on-failure) (make cluster-logs)")


@dataclass(frozen=True)
class Away:
    """One absence of the master: from ``left`` (wall clock) for ``seconds``, until it answered
    its healthcheck again (None: it never did while watched); ``status``: its exit status (None
    when Docker had started it again before the watch saw it stopped)."""

    left: float
    seconds: Optional[float]
    status: Optional[int]

    def words(self) -> str:
        when = time.strftime("%H:%M:%S", time.gmtime(self.left))
        how = f"exited with {self.status}" if self.status is not None else "exited or stopped answering"
        if self.seconds is None:
            return f"it {how} at {when} UTC and did not answer its healthcheck again"
        return (f"away for {self.seconds:.1f} s: it {how} at {when} UTC and answered its healthcheck "
                f"{self.seconds:.1f} s later (restarted by Compose)")


class MasterWatch:
    """A thread that watches the master container while the job runs (module docstring)."""

    def __init__(self, container: Any):
        self.container = container
        self.absences: List[Away] = []
        self._left: Optional[float] = None
        self._status: Optional[int] = None
        #: when this watch last saw the master healthy (None: not yet)
        self._healthy_at: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-master-watch", daemon=True)

    def start(self) -> "MasterWatch":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.look(time.time())
            except Exception:  # noqa: BLE001 - the engine hiccuped: look again
                continue

    def look(self, now: float) -> None:
        """One look: the master healthy, or not (since when, and why). Docker may have started it
        again before this look: its exit time is State.FinishedAt, newer than the last healthy look."""
        self.container.reload()
        state = self.container.attrs.get("State") or {}
        if state.get("Running") and (state.get("Health") or {}).get("Status") == "healthy":
            if self._left is not None:
                self.absences.append(Away(self._left, now - self._left, self._status))
                self._left = None
            self._healthy_at = now
            return
        if self._healthy_at is None:  # not up yet: the job has not begun
            return
        if self._left is None:
            self._left, self._status = now, None
        try:
            finished = outcome.parse_docker_time(state.get("FinishedAt") or "").at.timestamp()
        except ValueError:
            finished = None
        if finished is not None and self._healthy_at < finished < self._left:
            self._left = finished
        if not state.get("Running"):
            self._status = state.get("ExitCode")

    def stop(self) -> List[Away]:
        """Stop watching; the absences seen (one still going at the end has no length)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(POLL_S * 4 + 5)
        if self._left is not None:
            self.absences.append(Away(self._left, None, self._status))
            self._left = None
        return self.absences
