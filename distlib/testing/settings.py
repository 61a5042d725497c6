"""The variables the harness gives every process it starts (docs/settings.md, "The testing
harness"): the harness sets them, the ranks' side reads them; no user sets one.

They are named here once. ``_site/sitecustomize.py`` reads the same names with the standard
library alone (it runs in any interpreter, before the job imports distlib), so it spells them
out itself; tests/test_settings.py holds this module and the docs table to the same list.
"""

from __future__ import annotations

from typing import Mapping, Optional

from distlib.settings import text

#: The run's UNIX socket: a rank's process tells the harness who it is, each collective it
#: enters and how it ended.
SOCKET = "DISTLIB_TESTING_SOCKET"
#: The host (node) a process runs on, as the harness named it.
NODE = "DISTLIB_TESTING_NODE"
#: Where faulthandler writes a process's stacks when the deadline runs out.
STACKS = "DISTLIB_TESTING_STACKS"
#: The run's directory: a function job's arguments and return values, the fake GPU's exchange.
RUN_DIR = "DISTLIB_TESTING_RUN_DIR"
#: A directory every host of the run sees (a FileStore's home in the examples).
SHARED = "DISTLIB_TESTING_SHARED"
#: N: the CPU stand-in of CUDA and NCCL under cupy, with N devices.
FAKE_GPUS = "DISTLIB_TESTING_FAKE_GPUS"


def run_dir(env: Optional[Mapping[str, str]] = None) -> str:
    """The run's directory, or "" outside the harness."""
    return text(RUN_DIR, env=env)
