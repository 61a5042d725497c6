"""How the harness runs what needs root on this machine: directly as root, through
``sudo -n`` (GitHub's runners: passwordless sudo), or not at all (then it says why, once)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from typing import List, Optional, Sequence, Tuple

#: every privileged command has this deadline
COMMAND_TIMEOUT_S = 30.0


@functools.lru_cache(maxsize=None)
def prefix() -> Optional[Tuple[str, ...]]:
    """() as root, ("sudo", "-n") where passwordless sudo works, None otherwise."""
    if os.geteuid() == 0:
        return ()
    if shutil.which("sudo"):
        try:
            ok = subprocess.run(["sudo", "-n", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return ("sudo", "-n")
    return None


def why_not() -> Optional[str]:
    """None when privileged commands can run, else one line saying why not."""
    if prefix() is not None:
        return None
    return "this runner is not root and has no passwordless sudo"


def run(argv: Sequence[str], check: bool = True, timeout: float = COMMAND_TIMEOUT_S,
        input_text: Optional[str] = None) -> Tuple[int, str]:
    """Run ``argv`` with root's rights: (exit status, stdout+stderr). With ``check``, a failure
    raises RuntimeError naming the command and what it said."""
    pre = prefix()
    if pre is None:
        raise RuntimeError(f"{' '.join(argv)}: needs root ({why_not()})")
    full: List[str] = [*pre, *argv]
    try:
        done = subprocess.run(full, input=input_text, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, stdin=None if input_text is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(full)} did not finish within {timeout:.0f} s") from None
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed (exit {done.returncode}): {done.stdout.strip()[-500:]}")
    return done.returncode, done.stdout


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists, also when it is root's and this process may not signal it
    (a sweep of what an earlier run left must not take another user's process for gone)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
