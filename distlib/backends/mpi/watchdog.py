"""Deadlines for blocking MPI calls.

An MPI call can be neither interrupted nor cancelled: a collective waiting for a rank that
never comes blocks forever. So every blocking call of the mpi backend is registered here with
its group's timeout, and a daemon thread looks at the calls in flight every CHECK_INTERVAL
seconds. When one is overdue it asks the group's other ranks what they are doing
(inquiry.py), says what was waited for, in which group, for how long, and who has not
come, and aborts the job (runtime.abort), as torch's NCCL watchdog tears the process down:
an error raised in Python could not unblock the call, and the job would hang. The same thread
answers the other ranks' questions: what this rank is doing, and which groups it refuses
because they failed here (a rank waiting on such a rank is told why it never comes).

Registration is two dict operations (atomic under the GIL): no lock, no thread wake-up, so it
costs well under a microsecond next to a call that takes one.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...deadline import format_duration
from . import runtime as mpi_runtime
from .inquiry import Inquiry

#: Seconds between the watchdog's looks at the calls in flight (the lateness of an abort, and
#: of an answer to another rank's question).
CHECK_INTERVAL = 0.5
#: Seconds an overdue rank waits for the other ranks' answers (a few of their intervals).
ANSWER_WAIT = 3.0

_Entry = Tuple[float, float, str, Any, Any, int]  # (deadline, seconds, op, detail, backend, op number)
#: Operations that are not numbered: ranks do not take part in them alike.
_POINT_TO_POINT = ("send", "recv")


def describe(op: str, detail: Any) -> str:
    """``all_reduce of 1024 x float32``, from an op name and an array (or a text)."""
    if isinstance(detail, np.ndarray):
        return f"{op} of {detail.size} x {detail.dtype}"
    return f"{op} {detail}" if detail else op


def _number(seq: int) -> str:
    return f" (op #{seq})" if seq >= 0 else ""


class Watchdog:
    """The calls in flight of every mpi backend of this process, and the thread that ends a job
    whose call outlived its timeout."""

    def __init__(self) -> None:
        self._active: Dict[int, _Entry] = {}
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()
        #: when the last call ended, and what it was
        self._last_end: Tuple[float, Optional[_Entry]] = (time.monotonic(), None)
        self.inquiry: Optional[Inquiry] = None
        #: label -> the failure of each group this process refuses (its backend failed)
        self.failed_groups: Dict[str, str] = {}

    def group_failed(self, label: str, failure: str) -> None:
        """Group ``label`` failed on this rank with ``failure``: say so to whoever asks."""
        self.failed_groups[label] = failure

    def group_gone(self, label: str) -> None:
        """Group ``label`` was destroyed on this rank."""
        self.failed_groups.pop(label, None)

    def begin(self, seconds: float, op: str, detail: Any, backend: Any) -> int:
        """Register a blocking call; returns the token for ``end``."""
        token = next(self._ids)
        seq = -1 if op in _POINT_TO_POINT else backend.seq
        self._active[token] = (time.monotonic() + seconds, seconds, op, detail, backend, seq)
        if self._thread is None:
            self._start()
        return token

    def end(self, token: int) -> None:
        self._last_end = (time.monotonic(), self._active.pop(token, None))

    def in_flight(self, backend: Any = None) -> List[str]:
        """Descriptions of the calls in flight (of one backend, or all)."""
        return [f"{describe(e[2], e[3])} on {e[4].label}" for e in list(self._active.values())
                if backend is None or e[4] is backend]

    def answer_questions_with(self, MPI, comm) -> None:  # noqa: N803 - the module's own name
        """Serve the other ranks' questions on ``comm`` (once per process)."""
        with self._start_lock:
            if self.inquiry is None:
                self.inquiry = Inquiry(MPI, comm, self.state)
                mpi_runtime.before_finalize(self.inquiry.close)

    def state(self) -> Dict:
        """What this process is doing, for another rank's question."""
        now = time.monotonic()
        flights = [{"op": describe(op, detail), "seq": seq, "group": backend.label,
                    "for": round(now - (deadline - seconds), 1)}
                   for deadline, seconds, op, detail, backend, seq in list(self._active.values())]
        ended_at, last = self._last_end
        return {"host": socket.gethostname(), "in_flight": flights, "idle_for": round(now - ended_at, 1),
                "last": None if last is None else f"{describe(last[2], last[3])}{_number(last[5])} on {last[4].label}",
                "failed": dict(self.failed_groups)}

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="distlib-mpi-watchdog", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(CHECK_INTERVAL)
            if self.inquiry is not None:
                self.inquiry.serve()
            now = time.monotonic()
            for entry in list(self._active.values()):
                if now >= entry[0]:
                    mpi_runtime.abort(self.overdue_message(entry, self._ask_others(entry)))

    def _ask_others(self, entry: _Entry) -> Optional[Dict[int, Optional[Dict]]]:
        backend = entry[4]
        others = [r for r in getattr(backend, "global_ranks", []) if r != mpi_runtime.world_rank()]
        if self.inquiry is None or not others:
            return None
        return self.inquiry.ask(others, ANSWER_WAIT)

    @staticmethod
    def overdue_message(entry: _Entry, answers: Optional[Dict[int, Optional[Dict]]]) -> str:
        _, seconds, op, detail, backend, seq = entry
        text = (f"{describe(op, detail)}{_number(seq)} on {backend.describe_group()} did not finish within the "
                f"group timeout ({format_duration(seconds)})")
        if answers is None:
            return (text + ". MPI cannot cancel it and does not say which rank is missing: a rank of the group has "
                    "not reached this operation (it is stuck in its own code, stopped, or running another "
                    "operation: every rank must issue a group's operations in the same order)")
        waiting, others = [], []
        for rank, answer in sorted(answers.items()):
            if answer is None:
                others.append(f"rank {rank} did not answer within {format_duration(ANSWER_WAIT)} (stopped, or "
                              f"stuck in native code without releasing Python's GIL)")
                continue
            same = [f for f in answer["in_flight"] if f["group"] == backend.label and f["seq"] == seq]
            refused = answer.get("failed", {}).get(backend.label)
            if refused is not None:
                others.append(f"rank {rank} (host {answer['host']}) refuses every operation of {backend.label} since "
                              f"it failed there: {refused}")
            elif same and same[0]["op"] == describe(op, detail):
                waiting.append(str(rank))
            elif answer["in_flight"]:
                where = "; ".join(f"{f['op']}{_number(f['seq'])} on {f['group']} for {f['for']}s"
                                  for f in answer["in_flight"])
                others.append(f"rank {rank} (host {answer['host']}) is waiting in another operation: {where} "
                              f"(every rank must issue a group's operations in the same order)")
            else:
                last = f" (its last MPI call: {answer['last']})" if answer["last"] else ""
                others.append(f"rank {rank} (host {answer['host']}) is not in an MPI call: it has been in its own "
                              f"code for {answer['idle_for']}s{last}")
        text += ". " + ("Not there: " + "; ".join(others) if others else "Every other rank is waiting in it too")
        if waiting and others:
            text += f"; waiting in it too: rank{'s' if len(waiting) > 1 else ''} {', '.join(waiting)}"
        return text + ". MPI cannot cancel the call"


WATCHDOG = Watchdog()
mpi_runtime.report_in_flight_with(WATCHDOG.in_flight)
