"""Where each worker's stdout and stderr go, with torchrun's flags.

* **The console**: every line a worker writes reaches the launcher's stdout or stderr (the
  same stream) with its global rank in front, ``[rank3]: ...`` (``--log-line-prefix-template``,
  torch's, with ``${rank}``, ``${local_rank}``, ``${role_name}``; an empty template passes lines
  unchanged). Whole lines at a time, so the lines of two workers never mix; a partial line is
  passed on after ``PARTIAL_FLUSH_S`` of silence, and its continuation gets no second prefix.
  ``--local-ranks-filter 0,1`` shows only those local ranks (the files still get everything).
* **Files**: ``--redirects`` (``-r``) sends a stream to a file *instead of* the console,
  ``--tee`` (``-t``) to a file *and* the console. Both take torch's form: ``0`` none, ``1``
  stdout, ``2`` stderr, ``3`` both, for every local rank, or ``LOCAL_RANK:N,...`` per rank. The
  files are ``<log-dir>/<run id>_<random>/attempt_<restart count>/<local rank>/{stdout,stderr}.log``
  (torch's layout; without ``--log-dir`` a new temporary directory), written as the worker
  wrote them, without prefixes.
* **The tail**: the last ``TAIL_LINES`` lines of stderr are kept for the failure report,
  whatever is shown.
"""

from __future__ import annotations

import collections
import os
import secrets
import select
import sys
import tempfile
import threading
from dataclasses import dataclass
from string import Template
from typing import Deque, Dict, FrozenSet, IO, Optional

#: torchrun's prefix idea, with the global rank (what a user searching a log needs).
DEFAULT_PREFIX_TEMPLATE = "[rank${rank}]: "
TAIL_LINES = 20
#: A partial line (no newline yet) is passed on after this much silence.
PARTIAL_FLUSH_S = 0.2
STDOUT, STDERR = 1, 2

#: One lock for every write to the launcher's own stdout and stderr.
OUTPUT_LOCK = threading.Lock()
#: Per console file descriptor: the pump whose partial line it ends with (None: at a line start).
_MID_LINE: Dict[int, "Pump"] = {}


class OutputError(ValueError):
    """A value of --redirects, --tee or --local-ranks-filter that is not torch's form."""


def parse_std(text: str, flag: str) -> Dict[int, int]:
    """torch's Std form → {local rank: mask}, local rank -1 meaning every rank."""
    text = (text or "0").strip()
    if text.isdigit():
        mask = int(text)
        if mask > 3:
            raise OutputError(f"{flag} {text!r}: 0 (none), 1 (stdout), 2 (stderr) or 3 (both)")
        return {-1: mask}
    out: Dict[int, int] = {}
    for item in text.split(","):
        rank, sep, value = item.strip().partition(":")
        if not sep or not rank.strip().isdigit() or value.strip() not in ("0", "1", "2", "3"):
            raise OutputError(f"{flag} {text!r}: give 0..3 for every local rank, or LOCAL_RANK:0..3,... "
                              f"(e.g. 0:3,1:2); {item!r} is neither")
        out[int(rank)] = int(value)
    return out


def parse_ranks_filter(text: Optional[str]) -> Optional[FrozenSet[int]]:
    """``--local-ranks-filter 0,2`` → {0, 2}; empty → None (every rank shown)."""
    if not text or not text.strip():
        return None
    try:
        ranks = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise OutputError(f"--local-ranks-filter {text!r}: local ranks separated by commas, e.g. 0,1") from None
    if any(r < 0 for r in ranks):
        raise OutputError(f"--local-ranks-filter {text!r}: local ranks are 0 or more")
    return ranks


@dataclass(frozen=True)
class OutputSpec:
    """The output flags of one launch (module docstring)."""

    prefix_template: str = DEFAULT_PREFIX_TEMPLATE
    console_ranks: Optional[FrozenSet[int]] = None
    redirects: str = "0"
    tee: str = "0"
    #: this launch's own directory, ``<log-dir>/<run id>_<random>`` (``run_log_dir``)
    log_dir: Optional[str] = None

    def check(self) -> None:
        parse_std(self.redirects, "--redirects")
        parse_std(self.tee, "--tee")
        Template(self.prefix_template).safe_substitute(rank=0, local_rank=0, role_name="default")

    def needs_files(self) -> bool:
        return any(parse_std(self.redirects, "--redirects").values()) or any(parse_std(self.tee, "--tee").values())

    def _mask(self, text: str, flag: str, local_rank: int) -> int:
        table = parse_std(text, flag)
        return table.get(local_rank, table.get(-1, 0))

    def prefix(self, rank: int, local_rank: int, role: str) -> bytes:
        return Template(self.prefix_template).safe_substitute(
            rank=rank, local_rank=local_rank, role_name=role).encode()

    def destinations(self, stream: int, local_rank: int, attempt: int) -> "tuple[bool, Optional[str]]":
        """(shown on the console?, file path or None) for one worker's stream."""
        redirected = bool(self._mask(self.redirects, "--redirects", local_rank) & stream)
        teed = bool(self._mask(self.tee, "--tee", local_rank) & stream)
        shown = not redirected and (self.console_ranks is None or local_rank in self.console_ranks)
        path = None
        if (redirected or teed) and self.log_dir:
            name = "stdout.log" if stream == STDOUT else "stderr.log"
            path = os.path.join(self.log_dir, f"attempt_{attempt}", str(local_rank), name)
        return shown, path


    def error_file(self, local_rank: int, attempt: int) -> Optional[str]:
        """``TORCHELASTIC_ERROR_FILE`` of a worker, when there is a log directory (torch's
        ``@record`` writes the worker's exception there as JSON)."""
        if not self.log_dir:
            return None
        return os.path.join(self.log_dir, f"attempt_{attempt}", str(local_rank), "error.json")


def read_error_file(path: Optional[str]) -> Optional[str]:
    """The message a worker's ``@record`` left in its error file, or None."""
    import json

    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        message = data.get("message", data)
        if isinstance(message, dict):
            message = message.get("message", message)
        return str(message)
    except (OSError, ValueError, AttributeError):
        return None


def run_log_dir(base: Optional[str], run_id: str) -> str:
    """Make this launch's log directory: ``<base>/<run id>_<random>`` (a temporary base when None)."""
    base = base or tempfile.mkdtemp(prefix="distlib-run-logs-")
    path = os.path.join(base, f"{run_id}_{secrets.token_hex(4)}")
    os.makedirs(path, exist_ok=True)
    return path


class Pump:
    """Copies one stream of one worker to where ``OutputSpec`` says, in a thread."""

    def __init__(self, fd: int, console: Optional[IO], prefix: bytes, path: Optional[str], keep_tail: bool,
                 name: str):
        self._fd = fd
        self._console = console
        self._prefix = prefix
        self._file = None
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._file = open(path, "ab", buffering=0)
        self.tail: Deque[str] = collections.deque(maxlen=TAIL_LINES if keep_tail else 0)
        self._mid_line = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "Pump":
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _emit(self, data: bytes, to_file: bool = True) -> None:
        if self._file is not None and to_file:
            try:
                self._file.write(data)
            except OSError:
                pass
        if self.tail.maxlen:
            for line in data.decode("utf-8", "replace").splitlines():
                self.tail.append(line)
        if self._console is None:
            return
        with OUTPUT_LOCK:
            try:
                fd = self._console.fileno()
                self._console.flush()
            except (OSError, ValueError):
                return
            other = _MID_LINE.get(fd)
            if other is not None and other is not self:  # another worker's partial line: end it
                data_out = [b"\n"]
                other._mid_line = False
            else:
                data_out = []
            data_out.append(self._prefixed(data))
            if data.endswith(b"\n"):
                _MID_LINE.pop(fd, None)
            elif data:
                _MID_LINE[fd] = self
            try:
                os.write(fd, b"".join(data_out))
            except OSError:
                pass

    def _prefixed(self, data: bytes) -> bytes:
        """``data`` with the prefix at the start of each line (not before a continued line)."""
        if not self._prefix:
            self._mid_line = bool(data) and not data.endswith(b"\n") or (self._mid_line and not data)
            return data
        lines = data.split(b"\n")
        out = []
        for i, piece in enumerate(lines):
            last = i == len(lines) - 1
            if last and not piece:
                break
            start = b"" if (i == 0 and self._mid_line) else self._prefix
            out.append(start + piece + (b"" if last else b"\n"))
        if data:
            self._mid_line = not data.endswith(b"\n")
        return b"".join(out)

    def _run(self) -> None:
        pending = b""
        while True:
            ready, _, _ = select.select([self._fd], [], [], PARTIAL_FLUSH_S if pending else None)
            if not ready:
                self._emit(pending)
                pending = b""
                continue
            try:
                chunk = os.read(self._fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            pending += chunk
            cut = pending.rfind(b"\n") + 1
            if cut:
                self._emit(pending[:cut])
                pending = pending[cut:]
            if len(pending) > 65536:
                self._emit(pending)
                pending = b""
        if pending:
            self._emit(pending, to_file=True)
        if self._mid_line:  # end the console's line; the file keeps what the worker wrote
            self._emit(b"\n", to_file=False)
        try:
            os.close(self._fd)
        except OSError:
            pass
        if self._file is not None:
            self._file.close()


def write_lines(console: IO, data: bytes) -> None:
    """Whole lines of the launcher's own (``distlib-run: ...``) on ``console``, after ending a
    worker's partial line if one is pending there."""
    with OUTPUT_LOCK:
        try:
            fd = console.fileno()
            console.flush()
            other = _MID_LINE.pop(fd, None)
            if other is not None:
                other._mid_line = False
                data = b"\n" + data
            os.write(fd, data)
        except (OSError, ValueError):
            pass


def console_for(stream: int) -> IO:
    return sys.stdout if stream == STDOUT else sys.stderr
