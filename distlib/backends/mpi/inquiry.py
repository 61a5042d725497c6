"""Asking the other ranks what they are doing, when an MPI call is overdue.

MPI does not say which rank a collective is waiting for. So before the watchdog aborts a
job, the overdue rank asks each other rank of the group, and each one's watchdog thread
answers with what its process is doing: waiting in an MPI call (which operation, on which
group, for how long), or not in MPI at all (in its own code, since when, after which
operation). A rank that does not answer is stopped, or stuck without releasing Python's GIL.
The timeout error can then name the rank the others wait for, and tell a rank that is in its
own code from one that issued another operation (ranks that disagree on the order).

The questions and answers travel on a communicator of their own (a duplicate of
MPI_COMM_WORLD, made with the backend's first communicator), between watchdog threads only
(MPI_THREAD_MULTIPLE): a query is one byte, an answer a short JSON text in a fixed buffer.
Each watchdog looks for queries every time it wakes (watchdog.CHECK_INTERVAL).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable, Dict, List, Optional

import numpy as np

_TAG_QUERY, _TAG_ANSWER = 1, 2
#: Bytes of an answer (JSON; a longer one is cut to its in-flight list's first entries).
ANSWER_BYTES = 4096


class Inquiry:
    """The query/answer service of one process, on ``comm`` (a duplicate of MPI_COMM_WORLD)."""

    def __init__(self, MPI, comm, state: Callable[[], Dict]):  # noqa: N803 - the module's own name
        self.MPI, self.comm, self.state = MPI, comm, state
        self._lock = threading.Lock()
        self._closed = False
        self._query_buf = np.zeros(1, np.uint8)
        self._query = comm.Irecv([self._query_buf, MPI.BYTE], MPI.ANY_SOURCE, _TAG_QUERY)
        self._sends: List = []

    def serve(self) -> None:
        """Answer every query that has arrived (called by the watchdog thread)."""
        with self._lock:
            if self._closed:
                return
            status = self.MPI.Status()
            while self._query.Test(status):
                answer = self._encode(self.state())
                self._sends.append((answer, self.comm.Isend([answer, self.MPI.BYTE], status.Get_source(),
                                                            _TAG_ANSWER)))
                self._query = self.comm.Irecv([self._query_buf, self.MPI.BYTE], self.MPI.ANY_SOURCE, _TAG_QUERY)
            self._sends = [(buf, req) for buf, req in self._sends if not req.Test()]

    def ask(self, ranks: List[int], seconds: float) -> Dict[int, Optional[Dict]]:
        """Each rank's answer (None: none within ``seconds``), answering others meanwhile."""
        MPI = self.MPI
        answers: Dict[int, Optional[Dict]] = {r: None for r in ranks}
        with self._lock:
            if self._closed:
                return answers
            pending = {}
            for r in ranks:
                buf = np.zeros(ANSWER_BYTES, np.uint8)
                pending[r] = (buf, self.comm.Irecv([buf, MPI.BYTE], r, _TAG_ANSWER))
            for r in ranks:
                query = np.zeros(1, np.uint8)
                self._sends.append((query, self.comm.Isend([query, MPI.BYTE], r, _TAG_QUERY)))
        deadline = time.monotonic() + seconds
        while pending and time.monotonic() < deadline:
            self.serve()
            with self._lock:
                status = MPI.Status()
                for r, (buf, request) in list(pending.items()):
                    if request.Test(status):
                        answers[r] = json.loads(bytes(buf[:status.Get_count(MPI.BYTE)]).decode())
                        del pending[r]
            time.sleep(0.02)
        with self._lock:
            for _, request in pending.values():
                request.Cancel()
                request.Wait()
        return answers

    def close(self) -> None:
        """Stop answering (before MPI_Finalize: no receive may be left posted)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._query.Cancel()
            self._query.Wait()

    @staticmethod
    def _encode(state: Dict) -> np.ndarray:
        data = json.dumps(state).encode()
        while len(data) > ANSWER_BYTES and state.get("in_flight"):
            state = dict(state, in_flight=state["in_flight"][:-1])
            data = json.dumps(state).encode()
        return np.frombuffer(data[:ANSWER_BYTES], np.uint8).copy()
