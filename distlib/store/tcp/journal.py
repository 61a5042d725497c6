"""``Journal``: the store server's state directory (``distlib store-server --state-dir DIR``):
the changes of every loop turn appended to a journal file, replayed when the server starts,
compacted into a snapshot in the background.

Why: a master that is restarted (a pod rescheduled, the process OOM-killed) should come back
with the keys its jobs wrote, so that the jobs go on (issue 36). What is in DIR:

* ``incarnation``: 16 random bytes naming this directory's state (incarnation.py), made when
  the state is new; a client that reconnects checks it.
* ``lock``: held (flock) by the one server that uses DIR, with its pid; a second server is
  refused, since two writers would interleave their records.
* ``journal-N.log``: an 8-byte header, then frames (journal_records.py). The loop collects
  the frames of one turn in ``pending`` and ``commit()`` writes them with one write() before
  the turn's replies go out; with ``sync="turn"`` it fdatasyncs them too (group commit: one
  sync per turn, however many requests the turn ran). With ``sync="none"`` the write is left
  to the page cache: it survives the process's death (kill -9, OOM), not the machine's.
* ``snapshot-N.snap``: the live keys, queues and sessions as they were at the end of
  ``journal-N.log``, written by a thread from a copy taken in the loop (a dict copy: tens of
  milliseconds for a million keys), fsync'd and renamed into place; then the journals up to N
  and older snapshots are deleted, so DIR stays bounded by the live state (a compaction starts
  when the journal passes ``compact_bytes`` and twice the last snapshot).

Recovery reads the newest snapshot, then the journals after it, in order. A frame that ends
the newest journal and is incomplete or fails its crc (a crash mid-write) is dropped, the
file truncated there, and the log says so; any other bad frame refuses the start, naming the
file and the offset (the operator decides: nothing is silently lost). A crash at any step of
a compaction recovers: a ``.tmp`` snapshot is deleted, a renamed one is complete (written and
synced first), and journals it covers that were not deleted yet are skipped and deleted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import time
from typing import Callable, List, Optional, Tuple

from ...deadline import format_duration
from . import journal_records as records
from .incarnation import describe, directory_incarnation
from .journal_records import Image

log = logging.getLogger("distlib.store.tcp.journal")

JOURNAL_MAGIC = b"DLSJRN01"
SNAPSHOT_MAGIC = b"DLSSNP01"
#: The flush settings: "turn" (write and fdatasync each loop turn's changes before its
#: replies) and "none" (write them before the replies, sync left to the operating system).
SYNC_MODES = ("turn", "none")
DEFAULT_SYNC = "turn"
#: A journal past this size (and past twice the last snapshot) is compacted.
COMPACT_BYTES = 64 << 20
#: Records per snapshot frame (a frame is read back whole: a few MiB at most).
SNAPSHOT_FRAME_BYTES = 1 << 20

_JOURNAL = re.compile(r"journal-(\d{10})\.log$")
_SNAPSHOT = re.compile(r"snapshot-(\d{10})\.snap$")


class JournalError(RuntimeError):
    """The state directory cannot be used: held by another server, or damaged."""


def journal_name(number: int) -> str:
    return f"journal-{number:010d}.log"


def snapshot_name(number: int) -> str:
    return f"snapshot-{number:010d}.snap"


class Journal:
    """The state directory ``directory``, locked for this process. ``recover()`` first (it
    returns what to serve), then the loop appends frames to ``pending`` and calls
    ``commit()`` once per turn; ``close()`` at the end."""

    def __init__(self, directory: str, sync: str = DEFAULT_SYNC, compact_bytes: int = COMPACT_BYTES,
                 lock_wait: float = 0.0):
        if sync not in SYNC_MODES:
            raise ValueError(f"journal sync must be one of {', '.join(SYNC_MODES)}, not {sync!r}")
        self.directory = os.path.abspath(directory)
        self.sync = sync
        self.compact_bytes = compact_bytes
        #: Frames of this turn, written by ``commit()``.
        self.pending: List[bytes] = []
        #: Where the live state is copied from for a snapshot (set by the journaled state).
        self.copy_state: Optional[Callable[[], Image]] = None
        self.number = 0  # the journal file being appended to
        self.size = 0  # its size in bytes
        self.snapshot_bytes = 0  # the last snapshot's size
        self.compactions = 0  # finished ones
        #: Which state this is (incarnation.py): kept while the directory's state lives.
        self.incarnation = b""
        self._fd = -1
        self._compactor: Optional[threading.Thread] = None
        os.makedirs(self.directory, exist_ok=True)
        self._lock_fd = self._lock(lock_wait)

    # -- the lock ----------------------------------------------------------------------------------

    def _lock(self, wait: float) -> int:
        """The directory's lock, waiting up to ``wait`` seconds for a holder to let go: when a
        pod is deleted, Kubernetes starts its replacement while the old server is still on its
        way out, and on a node-local volume the new one would otherwise fail and be restarted
        with a back-off."""
        path = os.path.join(self.directory, "lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                if time.monotonic() < deadline:
                    if not said:
                        log.warning("state directory %s is locked by another distlib store-server (pid %s holds "
                                    "%s): waiting up to %s for it to stop", self.directory, holder, path,
                                    format_duration(wait))
                        said = True
                    time.sleep(0.1)
                    continue
                os.close(fd)
                waited = f" after waiting {format_duration(wait)}" if wait > 0 else ""
                raise JournalError(f"state directory {self.directory} is in use by another distlib store-server "
                                   f"(pid {holder} holds {path}){waited}; two servers on one directory would "
                                   f"corrupt its journal") from None
        if said:
            log.warning("state directory %s: the other server let go of its lock; going on", self.directory)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    # -- recovery ----------------------------------------------------------------------------------

    def _numbered(self, pattern) -> List[int]:
        found = []
        for name in os.listdir(self.directory):
            m = pattern.match(name)
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def recover(self) -> Image:
        """Replay the newest snapshot and the journals after it; open the journal to append to.
        Logs one line ('replayed N keys (M records, S sessions) from DIR in T')."""
        started = time.monotonic()
        for name in os.listdir(self.directory):
            if name.endswith(".tmp"):  # a compaction that did not finish
                os.unlink(os.path.join(self.directory, name))
        image = Image()
        snapshots = self._numbered(_SNAPSHOT)
        base = 0
        if snapshots:
            base = snapshots[-1]
            path = os.path.join(self.directory, snapshot_name(base))
            self.snapshot_bytes = self._replay(path, SNAPSHOT_MAGIC, image, last=False)
        journals = [n for n in self._numbered(_JOURNAL) if n > base]
        self.incarnation = directory_incarnation(self.directory, fresh=not snapshots and not journals)
        for i, number in enumerate(journals):
            path = os.path.join(self.directory, journal_name(number))
            size = self._replay(path, JOURNAL_MAGIC, image, last=i == len(journals) - 1)
            if i == len(journals) - 1:
                self.number, self.size = number, size
        self._delete_covered(base)
        if self.number == 0:
            self._open(base + 1)
        else:
            self._fd = os.open(os.path.join(self.directory, journal_name(self.number)), os.O_WRONLY | os.O_APPEND)
        log.info("replayed %d keys (%d records, %d sessions) from %s in %s; state incarnation %s",
                 len(image.data), image.records, len(image.sessions), self.directory,
                 format_duration(time.monotonic() - started), describe(self.incarnation))
        return image

    def _replay(self, path: str, magic: bytes, image: Image, last: bool) -> int:
        """Apply the frames of ``path``; its size after any truncation."""
        with open(path, "rb") as fh:
            buf = fh.read()
        if len(buf) < len(magic):
            if last and magic == JOURNAL_MAGIC and magic.startswith(buf):  # created, header cut short
                self._truncate(path, 0, len(buf), "an incomplete header")
                with open(path, "wb") as fh:
                    fh.write(JOURNAL_MAGIC)
                return len(JOURNAL_MAGIC)
            raise JournalError(f"{path}: not a distlib store journal (a {len(buf)}-byte file); move it out of "
                               f"{self.directory} to start without it")
        if buf[:len(magic)] != magic:
            raise JournalError(f"{path}: not a distlib store {'journal' if magic == JOURNAL_MAGIC else 'snapshot'} "
                               f"(header {buf[:len(magic)]!r}); move it out of {self.directory} to start without it")
        spans, end, damage = records.scan(buf, len(magic))
        for start, stop in spans:
            try:
                records.apply(image, buf, start, stop)
            except records.BadRecord as exc:
                raise JournalError(f"{path}: bad record in the frame at offset {start - records.FRAME.size}: {exc}; "
                                   f"the server will not start on a damaged state") from None
        if damage is None:
            return len(buf)
        if damage == "torn" and last:
            self._truncate(path, end, len(buf) - end, "a torn last record (a write cut short by a crash)")
            return end
        raise JournalError(
            f"{path}: damaged record at offset {end} of {len(buf)} bytes ("
            f"{'a frame that fails its checksum with records after it' if damage == 'corrupt' else 'an incomplete frame'}"
            f"{'' if last else ' in a file that is not the newest'}); the server will not start on a damaged state: "
            f"restore {os.path.basename(path)}, or truncate it at {end} to keep the records before it")

    def _truncate(self, path: str, offset: int, dropped: int, what: str) -> None:
        log.warning("journal %s: dropped %s at offset %d (%d bytes); the records before it are kept",
                    path, what, offset, dropped)
        with open(path, "r+b") as fh:
            fh.truncate(offset)
            fh.flush()
            os.fsync(fh.fileno())

    def _delete_covered(self, base: int) -> None:
        """Delete the journals a snapshot ``base`` covers, and older snapshots."""
        for number in self._numbered(_JOURNAL):
            if number <= base:
                os.unlink(os.path.join(self.directory, journal_name(number)))
        for number in self._numbered(_SNAPSHOT):
            if number < base:
                os.unlink(os.path.join(self.directory, snapshot_name(number)))

    def _open(self, number: int) -> None:
        """Start journal ``number`` (the one before it, if any, is closed)."""
        path = os.path.join(self.directory, journal_name(number))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        os.write(fd, JOURNAL_MAGIC)
        os.fsync(fd)
        _sync_directory(self.directory)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self.number, self.size = fd, number, len(JOURNAL_MAGIC)

    # -- the loop's calls --------------------------------------------------------------------------

    def commit(self) -> None:
        """Write this turn's frames with one write() (and fdatasync them with ``sync="turn"``);
        start a compaction when the journal has grown past its bound."""
        pending = self.pending
        if not pending:
            return
        data = b"".join(pending) if len(pending) > 1 else pending[0]
        pending.clear()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        if self.sync == "turn":
            os.fdatasync(self._fd)
        self.size += len(data)
        if self.size > self.compact_bytes and self.size > 2 * self.snapshot_bytes and self.copy_state is not None:
            if self._compactor is None or not self._compactor.is_alive():
                self.compact()

    def compact(self) -> threading.Thread:
        """Start a compaction: a fresh journal from now on, and a thread that writes a snapshot
        of the state as of now (copied here) and then deletes what it covers."""
        assert self.copy_state is not None
        number = self.number
        if self.sync == "none":  # the snapshot will replace it; until then it must be whole on disk
            os.fdatasync(self._fd)
        self._open(number + 1)
        image = self.copy_state()
        self._compactor = threading.Thread(target=self._write_snapshot, args=(number, image),
                                           name="distlib-store-compaction", daemon=True)
        self._compactor.start()
        return self._compactor

    def wait_compaction(self, timeout: float) -> bool:
        """Whether no compaction is running, after waiting for one up to ``timeout`` seconds."""
        thread = self._compactor
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _write_snapshot(self, number: int, image: Image) -> None:
        started = time.monotonic()
        final = os.path.join(self.directory, snapshot_name(number))
        tmp = final + ".tmp"
        try:
            size = write_snapshot(tmp, image)
            os.rename(tmp, final)
            _sync_directory(self.directory)
            self._delete_covered(number)
        except OSError as exc:
            log.warning("journal compaction into %s failed (%s); the journals are kept and it will be tried again",
                        final, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        self.snapshot_bytes = size
        self.compactions += 1
        log.info("compacted the journal of %s: a snapshot of %d keys (%d bytes) in %s", self.directory,
                 len(image.data), size, format_duration(time.monotonic() - started))

    def close(self) -> None:
        """Write what is pending, wait for a compaction, release the directory."""
        if self._fd >= 0:
            try:
                self.commit()
                os.fsync(self._fd)
            except OSError as exc:  # (the server stopped on it already, or it is stopping)
                log.error("journal in %s: the last writes at close failed: %s", self.directory, exc)
            os.close(self._fd)
            self._fd = -1
        self.wait_compaction(60.0)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def write_snapshot(path: str, image: Image) -> int:
    """Write ``image`` to ``path`` as frames of records, fsync'd; its size."""
    size = 0
    with open(path, "wb") as fh:
        fh.write(SNAPSHOT_MAGIC)
        size += len(SNAPSHOT_MAGIC)
        batch: List[bytes] = []
        held = 0

        def flush() -> None:
            nonlocal held, size
            if batch:
                framed = records.frame(b"".join(batch))
                fh.write(framed)
                size += len(framed)
                batch.clear()
                held = 0

        for item in _snapshot_records(image):
            batch.append(item)
            held += len(item)
            if held >= SNAPSHOT_FRAME_BYTES:
                flush()
        flush()
        fh.flush()
        os.fsync(fh.fileno())
    return size


def _snapshot_records(image: Image):
    set_record, push_record = records.set_record, records.push_record
    for key, value in image.data.items():
        yield set_record(key, value)
    for key, queue in image.queues.items():
        for value in queue:
            yield push_record(key, value)
    for session, entry in image.sessions.items():
        yield records.session_record(session, entry.seq, entry.used, entry.reply)


def _sync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_sync(sync: str) -> str:
    return {"turn": "each turn's changes written and fdatasync'd before its replies",
            "none": "each turn's changes written before its replies, synced by the OS"}[sync]


__all__: Tuple[str, ...] = ("Journal", "JournalError", "SYNC_MODES", "DEFAULT_SYNC", "COMPACT_BYTES",
                            "describe_sync", "write_snapshot")
