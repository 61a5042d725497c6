"""The contract between the cluster (cluster.py) and what its hosts are made of: processes on
this machine (processes.py) or containers (containers.py).

A substrate makes hosts with names and addresses, starts one command on each, and acts on them
from outside (signals, the network namespace, the shared directory). Everything else (the
master service, the reports, the schedule, the records) is the cluster's, the same for both.
"""

from __future__ import annotations

from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Protocol, Sequence

#: on_line(host, stream, line): one line of a host's stdout or stderr
LineSink = Callable[[str, str, str], None]

#: What a substrate can do; a schedule that needs more is refused before the job starts.
ABILITIES = ("signals", "network", "netem", "names", "disk", "readonly", "master")


class Host(Protocol):
    name: str
    address: str

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, on_line: LineSink) -> None:
        """Start the host's one command (output lines to ``on_line``)."""

    def poll(self) -> Optional[int]:
        """None while the command runs; its exit status after (-N: ended by signal N)."""

    def kill(self) -> str:
        """SIGKILL everything running on the host; a line saying what was killed."""

    def pause(self) -> str: ...

    def resume(self) -> str: ...

    def signal_pid(self, pid: int, signum: int) -> bool:
        """Send ``signum`` to the process that calls itself ``pid`` on this host; False if gone."""

    def link(self):  # -> netfaults.HostLink
        """The host's network fault rules (only where the substrate has "network")."""

    def release(self) -> None:
        """Kill what still runs and free what the host holds (idempotent)."""


class Substrate(Protocol):
    kind: str
    #: the user's project directory and the run directory, at the same path on every host
    abilities: FrozenSet[str]
    missing: Dict[str, str]   # ability -> the one line saying why it is missing

    def make_hosts(self, names: List[str]) -> Dict[str, Host]:
        """Hosts with these names (their addresses assigned), nothing started yet."""

    def python_paths(self, host: str) -> List[str]:
        """The paths that lead ``host``'s PYTHONPATH (the harness's sitecustomize, as the host
        sees it; for the master, the harness's own distlib where the host has another)."""

    def interpreter(self) -> str:
        """The Python the hosts run (``sys.executable`` here, ``python3`` in an image)."""

    def disk(self, state: str) -> str:
        """The shared directory full / readonly / ok."""

    def close(self) -> None:
        """Release every host and everything else this substrate made."""
