"""How a tool ends a child process it started (a store server, slurmctld): SIGTERM, which
the child handles by exiting cleanly, then SIGKILL when it has not exited within a grace
period (a server under load may be too busy to exit at once). One place, so that every
tool and test waits the same way and none leaves a zombie behind."""

from __future__ import annotations

import subprocess
from typing import Optional


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> Optional[int]:
    """Terminate ``proc``, kill it after ``grace_s``; its exit status (it was reaped)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)
    return proc.returncode
