"""``Communicator``: the one owner of a cupy NcclCommunicator, so that NCCL calls on it never
overlap and nothing touches it after it is aborted or destroyed.

Why: NCCL calls on one communicator are not thread-safe, and cupy's ``abort()`` frees the
communicator (ncclCommAbort) while another thread may be inside a call that already read its
pointer: a use after free, which on the GPU was a SIGSEGV with no Python error (issue 25: the
watchdog thread aborting while the main thread enqueued). Here the caller's enqueue
(``acquire``/``release`` around one operation's calls), the watchdog's error poll and abort,
and destroy each take one lock. Two waits are bounded on purpose:

* ``abort`` waits ABORT_GRACE_S for a call in progress to return. A call that has not returned
  by then is blocked inside NCCL on a peer, and unblocking it is what ncclCommAbort is for, so
  the abort then goes ahead and says so.
* ``destroy`` (ncclCommDestroy, which finalizes: it waits for the communicator's work and may
  need its peers) runs in a helper thread joined with a deadline; one that does not return is
  left to the process's exit, with a warning, rather than hanging destroy_process_group.

Creation (ncclCommInitRank, which waits for every rank) has the group timeout the same way; a
communicator that arrives after its waiter gave up is aborted, never left to the garbage
collector (cupy's finalizer would call a blocking ncclCommDestroy from whatever thread).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Optional

from ...deadline import format_duration
from ...errors import DistBackendError
from .lifecycle import Lifecycle

log = logging.getLogger("distlib.backends.nccl")

#: How long an abort waits for an NCCL call of another thread to return first.
ABORT_GRACE_S = 5.0
#: How long destroy waits for ncclCommDestroy (the operations have finished by then).
DESTROY_S = 10.0
#: How long the watchdog's error poll waits for an enqueue in progress (it asks again later).
POLL_WAIT_S = 0.05

LIVE, ABORTED, DESTROYING, DESTROYED = "live", "aborted", "being destroyed", "destroyed"


def _in_thread(fn: Callable[[], Any], name: str, seconds: float) -> Dict[str, Any]:
    """``fn()`` in a daemon thread joined for ``seconds``: {"value"|"error"|"running": ...}."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        box["running"] = thread
    return box


class Communicator:
    """A cupy NcclCommunicator used by one thread at a time (see the module docstring)."""

    def __init__(self, raw, nccl, label: str, lifecycle: Lifecycle):
        self._raw, self._nccl, self.label, self.lifecycle = raw, nccl, label, lifecycle
        self._lock = threading.Lock()
        self.state = LIVE

    @classmethod
    def create(cls, nccl, size: int, unique_id, rank: int, use_device: Callable[[], Any], seconds: float,
               label: str, lifecycle: Lifecycle) -> "Communicator":
        """ncclCommInitRank with a deadline.

        Args:
            nccl: cupy.cuda.nccl (or the test suite's fake).
            size, unique_id, rank: the communicator's.
            use_device: a context manager factory making the rank's GPU current.
            seconds: the deadline (the group timeout).
            label: "pg0/nccl rank 3", for the texts.
            lifecycle: the group's state (an operation refused because the communicator was
                aborted raises the group's error).

        Returns:
            The Communicator.

        Raises:
            DistBackendError: it did not finish in time, or NCCL refused ("... failed: <why>").
        """
        gave_up = threading.Event()

        def make():
            with use_device():
                raw = nccl.NcclCommunicator(size, unique_id, rank)
            if gave_up.is_set():  # nobody will ever use or destroy it: abort, do not leak it to the GC
                raw.abort()
            return raw

        box = _in_thread(make, f"distlib-nccl-init-{label}", seconds)
        if "running" in box:
            gave_up.set()
            raise DistBackendError(f"{label}: ncclCommInitRank did not finish within {format_duration(seconds)}")
        if "error" in box:
            raise DistBackendError(f"{label}: ncclCommInitRank failed: {box['error']}") from box["error"]
        return cls(box["value"], nccl, label, lifecycle)

    # -- the caller's enqueue ---------------------------------------------------------------------

    def acquire(self):
        """The raw communicator for one operation's calls, held until ``release()``.

        Raises:
            DistBackendError: the group's error (the communicator was aborted because the group
                failed), or that the communicator was aborted or destroyed.
        """
        self._lock.acquire()
        if self.state is not LIVE:
            self._lock.release()
            self.lifecycle.raise_if_failed()  # aborted by the watchdog meanwhile: its error, not this one
            raise DistBackendError(f"{self.label}: the NCCL communicator was {self.state}")
        return self._raw

    def release(self) -> None:
        self._lock.release()

    # -- the watchdog -----------------------------------------------------------------------------

    def async_error(self) -> Optional[str]:
        """NCCL's asynchronous error as a cause ("failed: NCCL reported ..."), or None (also when
        an enqueue holds the communicator: the next poll asks again)."""
        if not self._lock.acquire(timeout=POLL_WAIT_S):
            return None
        try:
            if self.state is not LIVE:
                return None
            self._raw.check_async_error()
        except self._nccl.NcclError as exc:
            return f"failed: NCCL reported {exc}"
        finally:
            self._lock.release()
        return None

    def abort(self) -> None:
        """ncclCommAbort: enqueued work is dropped, stuck kernels end. Idempotent; never raises."""
        got = self._lock.acquire(timeout=ABORT_GRACE_S)
        try:
            if self.state is not LIVE:
                return
            if not got:
                log.warning("%s: an NCCL call of another thread has not returned for %s: aborting the communicator "
                            "without waiting for it (ncclCommAbort is what unblocks it)", self.label,
                            format_duration(ABORT_GRACE_S))
            self.state = ABORTED
            try:
                self._raw.abort()
            except Exception as exc:  # noqa: BLE001 - the failure being reported matters more
                log.warning("%s: aborting the NCCL communicator failed: %s", self.label, exc)
        finally:
            if got:
                self._lock.release()

    # -- destroy ----------------------------------------------------------------------------------

    def destroy(self, seconds: float = DESTROY_S) -> bool:
        """ncclCommDestroy (after the communicator's work has finished), within ``seconds``.

        Returns:
            True once destroyed (or already aborted/destroyed); False if it did not return in
            time (logged; the helper thread is left to the process's exit).
        """
        with self._lock:
            if self.state is not LIVE:
                return True
            self.state = DESTROYING
            box = _in_thread(self._raw.destroy, f"distlib-nccl-destroy-{self.label}", seconds)
            if "running" in box:
                log.warning("%s: ncclCommDestroy did not return within %s (a peer gone?): the communicator is left to "
                            "the process's exit", self.label, format_duration(seconds))
                return False
            self.state = DESTROYED
            if "error" in box:
                log.warning("%s: ncclCommDestroy failed: %s", self.label, box["error"])
            return True
