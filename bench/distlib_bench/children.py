"""The benchmarks' child processes: each measured load runs in children, never in the process
that prints, so each implementation gets fresh processes with nothing of the other's state in
them. A child that fails surfaces its traceback (``ChildError``); every wait on a child has a
timeout.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
import traceback
from typing import Any, Callable, Optional, Tuple

#: Children are forked: the parent imports what they need once (torch takes seconds), and a
#: fork starts in milliseconds. The parent must not run threads when it forks.
FORK = multiprocessing.get_context("fork")


class BenchError(RuntimeError):
    """A benchmark could not run a load (a child failed, hung or sent nonsense)."""


class ChildError(BenchError):
    """A child process raised; the message carries its traceback."""


def _child_main(target: Callable, conn, args: tuple) -> None:
    try:
        result = target(conn, *args)
    except BaseException:  # noqa: BLE001 - the parent shows it
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001 - the parent is gone
            pass
        os._exit(1)
    try:
        conn.send(("done", result))
    except Exception:  # noqa: BLE001
        pass
    conn.close()


class Child:
    """``target(conn, *args)`` in a forked process, talking to the parent over a pipe.

    The target may ``conn.send`` messages (``recv`` returns them) and ``conn.recv`` the
    parent's; its return value arrives as the last message (``result``). An exception in
    the child is re-raised here as ChildError with the child's traceback.
    """

    def __init__(self, target: Callable, *args: Any, name: Optional[str] = None):
        self.name = name or getattr(target, "__name__", "child")
        # Objects that exist now stay out of the cyclic GC's reach, in the parent and in the
        # child: a collection in the child would otherwise touch (and copy) every page of
        # the parent's heap, a cost of forking that no measured implementation should pay.
        gc.freeze()
        self._conn, child_conn = FORK.Pipe()
        self.proc = FORK.Process(target=_child_main, args=(target, child_conn, args), name=self.name, daemon=True)
        self.proc.start()
        child_conn.close()
        self._result: Any = None
        self._finished = False

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid

    def send(self, obj: Any) -> None:
        self._conn.send(obj)

    def recv(self, timeout: float) -> Any:
        """The child's next message. Raises ChildError if it failed, BenchError on timeout
        or if it finished instead (its result is kept for ``result``)."""
        if self._finished:
            raise BenchError(f"{self.name} (pid {self.pid}) has already finished")
        kind, rest = self._next(timeout, f"sent nothing within {timeout:.0f} s", "without a word")
        if kind == "done":
            raise BenchError(f"{self.name} (pid {self.pid}) finished while a message was expected")
        return rest[0] if len(rest) == 1 else tuple(rest)

    def result(self, timeout: float) -> Any:
        """Wait for the child to finish; its return value. Messages it sends first are
        skipped."""
        deadline = time.monotonic() + timeout
        while not self._finished:
            self._next(deadline - time.monotonic(), f"did not finish within {timeout:.0f} s", "without a result")
        self.proc.join(timeout=max(1.0, deadline - time.monotonic()))
        return self._result

    def _next(self, timeout: float, late: str, silent: str) -> Tuple[str, list]:
        """One message from the child, as (kind, rest). A failure is raised (ChildError); a
        result ("done") is kept and ends the child. ``late`` and ``silent`` finish the
        errors for a timeout and for an exit without a message."""
        if timeout <= 0 or not self._conn.poll(timeout):
            raise BenchError(f"{self.name} (pid {self.pid}) {late}"
                             + ("" if self.proc.is_alive() else f"; it exited with {self.proc.exitcode}"))
        try:
            kind, *rest = self._conn.recv()
        except EOFError:
            self.proc.join(5)
            raise BenchError(f"{self.name} (pid {self.pid}) exited with {self.proc.exitcode} {silent}") from None
        if kind == "error":
            self._finished = True
            raise ChildError(f"{self.name} (pid {self.pid}) failed:\n{rest[0]}")
        if kind == "done":
            self._finished = True
            self._result = rest[0]
        return kind, rest

    def stop(self, timeout: float = 5.0) -> None:
        """Ask politely (a "stop" message), then terminate, then kill."""
        if self.proc.is_alive():
            try:
                self._conn.send(("stop",))
            except (OSError, ValueError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout)
        self._conn.close()

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def run_child(target: Callable, *args: Any, timeout: float, name: Optional[str] = None) -> Any:
    """Run ``target(conn, *args)`` in a child and return its result."""
    child = Child(target, *args, name=name)
    try:
        return child.result(timeout)
    finally:
        child.stop()


def child_pythonpath(inherited: str = "") -> str:
    """A PYTHONPATH under which a child process imports the same distlib, distlib_deploy and
    distlib_bench as this one, installed or not (a plain copy of the tree, as on the GPU
    machine), ahead of ``inherited``."""
    import os
    from pathlib import Path

    import distlib
    import distlib_deploy

    roots = []
    for m in (distlib, distlib_deploy):
        assert m.__file__ is not None, f"{m.__name__} is a regular package (it has an __init__.py)"
        roots.append(str(Path(m.__file__).resolve().parents[1]))
    roots.append(str(Path(__file__).resolve().parents[1]))
    rest = [p for p in inherited.split(os.pathsep) if p and p not in roots]
    return os.pathsep.join(dict.fromkeys(roots + rest))
