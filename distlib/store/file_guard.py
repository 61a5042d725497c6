"""FileStore operations with a deadline on network file systems, whose server can stop answering.

On a ``hard`` NFS mount (the default) every system call FileStore makes (open, flock, read,
stat) blocks in the kernel while the server is down, restarting or in its grace period, for
as long as that lasts: no timeout of FileStore's could fire, and a rank would hang without a
word. ``guard()`` wraps the ``LogFile`` of a store on such a mount in ``GuardedLog``: each
operation runs in the store's helper thread while the caller waits, at most the bound every
FileStore operation already has for a busy lock (``lock_wait_s``: the store timeout, at least
30 s), logging a WARNING that names the server every few seconds while it waits; past the
bound it raises DistStoreError naming the server, the mount and the operation. A server that
comes back in time (a restart, a grace period) costs only the wait. Local files are not
wrapped: their operations cost what they did.

After a give-up the blocked call is still in the kernel (nothing can cancel it) and may yet
complete when the server answers; until it returns, every further operation of that store
fails at once with the same explanation instead of queueing behind it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from typing import Any, Callable, Optional

from ..deadline import Deadline, format_duration
from ..errors import DistStoreError
from .file_mounts import MountInfo

log = logging.getLogger("distlib.store.file")

#: File systems whose calls wait on a server (fstype as /proc/self/mountinfo names it).
NETWORK_FILE_SYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "ceph", "lustre", "gpfs", "beegfs",
                                  "fuse.glusterfs", "fuse.sshfs"})
#: A call blocked this long is reported (a healthy NFS operation takes milliseconds) ...
FIRST_WARNING_S = 2.0
#: ... and again every this many seconds while it stays blocked.
WARNING_EVERY_S = 5.0

#: LogFile methods that do I/O on the file (the others only read its attributes).
_BLOCKING = frozenset({"join", "lookup", "has_all", "has_user_keys", "snapshot", "set", "add", "compare_set",
                       "delete", "close", "check_identity"})


def guard(log_file, mount: Optional[MountInfo]):
    """``log_file`` itself on a local file system; a GuardedLog over it on a network one."""
    if mount is None or mount.fstype not in NETWORK_FILE_SYSTEMS:
        return log_file
    return GuardedLog(log_file, mount)


class _Call:
    __slots__ = ("name", "fn", "args", "done", "result", "error")

    def __init__(self, name: str, fn: Callable[..., Any], args: tuple):
        self.name, self.fn, self.args = name, fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None


def _serve(calls: "queue.SimpleQueue[Optional[_Call]]") -> None:
    """The helper thread: run calls until told to stop (None)."""
    while True:
        call = calls.get()
        if call is None:
            return
        try:
            call.result = call.fn(*call.args)
        except BaseException as exc:  # handed to the caller, which raises it
            call.error = exc
        call.done.set()


class GuardedLog:
    """A LogFile whose I/O runs in a helper thread, each call waited for with a deadline.

    Attributes and the non-blocking methods are the LogFile's own (read and written through).
    """

    def __init__(self, log_file, mount: MountInfo):
        object.__setattr__(self, "_log", log_file)
        object.__setattr__(self, "_mount", mount)
        object.__setattr__(self, "_calls", None)
        object.__setattr__(self, "_pid", -1)
        object.__setattr__(self, "_busy", None)  # the call still blocked after a give-up

    def __getattr__(self, name: str):
        value = getattr(self._log, name)
        if name in _BLOCKING:
            return lambda *args: self._call(name, value, args)
        return value

    def __setattr__(self, name: str, value) -> None:
        setattr(self._log, name, value)

    def _server(self) -> str:
        m = self._mount
        kind = "NFS server" if m.fstype.startswith("nfs") else f"{m.fstype} server"
        return f"{kind} {m.source} (mount {m.mount_point}, {m.fstype})"

    def _queue(self) -> "queue.SimpleQueue[Optional[_Call]]":
        """The helper thread's queue; a new thread in a new process (after fork)."""
        if self._pid != os.getpid():
            calls: "queue.SimpleQueue[Optional[_Call]]" = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(calls,), name=f"distlib-filestore-io {self._log.path}",
                             daemon=True).start()
            weakref.finalize(self, calls.put, None)
            object.__setattr__(self, "_calls", calls)
            object.__setattr__(self, "_pid", os.getpid())
            object.__setattr__(self, "_busy", None)
        return self._calls

    def _call(self, name: str, fn: Callable[..., Any], args: tuple):
        busy = self._busy
        if busy is not None and busy[0].done.is_set():
            object.__setattr__(self, "_busy", None)
            busy = None
        if busy is not None:
            call, since = busy
            raise DistStoreError(
                f"FileStore: store file {self._log.path}: {name} not started: the {call.name} given up on "
                f"{format_duration(since.elapsed() - since.seconds)} ago is still blocked in the kernel, "
                f"waiting for the {self._server()} to answer")
        calls = self._queue()
        call = _Call(name, fn, args)
        calls.put(call)
        bound = Deadline(self._log.lock_wait_s)
        try:
            self._wait(call, bound)
        except BaseException:  # given up (or interrupted): later calls must not queue behind it
            if not call.done.is_set():
                object.__setattr__(self, "_busy", (call, bound))
            raise
        if call.error is not None:
            raise call.error
        return call.result

    def _wait(self, call: _Call, bound: Deadline) -> None:
        """Wait for ``call`` until ``bound``, warning while it is blocked; DistStoreError past it."""
        warn_at = FIRST_WARNING_S
        while not call.done.wait(max(0.0, min(warn_at - bound.elapsed(), bound.remaining()))):
            if bound.expired():
                raise DistStoreError(
                    f"FileStore: store file {self._log.path}: {call.name} got no answer from the file system "
                    f"for {format_duration(bound.seconds)}: the {self._server()} is down, restarting or "
                    f"unreachable (a hard mount retries for ever). Gave up; the call stays blocked in the kernel "
                    f"and may still complete when the server answers")
            if bound.elapsed() >= warn_at:
                log.warning("FileStore %s: %s has waited %s for the %s: down or restarting (grace period)? "
                            "Still waiting, at most %s", self._log.path, call.name, format_duration(bound.elapsed()),
                            self._server(), format_duration(bound.seconds))
                warn_at += WARNING_EVERY_S
