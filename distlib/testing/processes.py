"""The process substrate: each host is processes on this machine.

Where the harness has root (or passwordless sudo), a host is a set of namespaces
(namespaces.py): its own network stack and address, its own host name, and the cluster's
hosts file as /etc/hosts; every fault is available (delay where the kernel has netem). Without
root, hosts are process groups sharing this machine's name and loopback address: kills, pauses,
output and collective cues and the master's restart work, network, name and disk faults do not
(``missing`` says so).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from . import privilege
from .namespaces import Fabric, NamespaceHost, netns_pids, unavailable
from .netfaults import HostLink, netem_missing
from .substrate import LineSink

#: shared directory (the FileStore's place) size: small, so that "full" is quick to reach
SHARED_MB = 64
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
_ENTER = ('hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" /etc/resolv.conf && shift 3 '
          '&& exec "$@"')


def _read_lines(stream, host: str, name: str, on_line: LineSink) -> None:
    with contextlib.suppress(ValueError, OSError):
        for raw in stream:
            on_line(host, name, raw.decode("utf-8", "replace").rstrip("\n"))


def _session_pids(sid: int) -> List[int]:
    """Processes of session ``sid`` (a loopback host's processes: they inherit its session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 3 and int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


class ProcessHost:
    """One host: a command started in the host's namespaces (or a session of its own)."""

    def __init__(self, name: str, address: str, ns: Optional[NamespaceHost], hosts_file: Optional[str]):
        self.name = name
        self.address = address
        self.ns = ns
        self.hosts_file = hosts_file
        self.proc: Optional[subprocess.Popen] = None
        self._link: Optional[HostLink] = None

    def _command(self, argv: Sequence[str], env: Mapping[str, str]) -> Tuple[List[str], Optional[Dict[str, str]]]:
        if self.ns is None:
            return list(argv), dict(env)
        pre = privilege.prefix() or ()
        drop: List[str] = []
        if pre:  # through sudo: set the environment explicitly, run the job as the user again
            drop = ["setpriv", f"--reuid={os.getuid()}", f"--regid={os.getgid()}", "--init-groups", "--"]
        inner = ["ip", "netns", "exec", self.ns.netns, "unshare", "--uts", "--", "sh", "-c", _ENTER, "sh",
                 self.name, str(self.hosts_file), os.path.join(os.path.dirname(str(self.hosts_file)), "resolv.conf"),
                 *drop, *argv]
        if pre:
            return [*pre, "env", "-i", *[f"{k}={v}" for k, v in env.items()], *inner], None
        return inner, dict(env)

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, on_line: LineSink) -> None:
        command, environment = self._command(argv, env)
        self.proc = subprocess.Popen(command, env=environment, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        for stream, label in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr")):
            threading.Thread(target=_read_lines, args=(stream, self.name, label, on_line),
                             name=f"distlib-testing-{self.name}-{label}", daemon=True).start()

    def poll(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def pids(self) -> List[int]:
        if self.ns is not None:
            return netns_pids(self.ns.netns)
        return _session_pids(self.proc.pid) if self.proc is not None else []

    def _signal_all(self, signum: int) -> List[int]:
        hit = []
        for pid in self.pids():
            if self.signal_pid(pid, signum):
                hit.append(pid)
        return hit

    def kill(self) -> str:
        hit = self._signal_all(signal.SIGKILL)
        return f"SIGKILL to {self.name}'s {len(hit)} process(es) {hit}"

    def pause(self) -> str:
        return f"SIGSTOP to {self.name}'s processes {self._signal_all(signal.SIGSTOP)}"

    def resume(self) -> str:
        return f"SIGCONT to {self.name}'s processes {self._signal_all(signal.SIGCONT)}"

    def signal_pid(self, pid: int, signum: int) -> bool:
        try:
            os.kill(pid, signum)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:  # a process still root's (before setpriv), through sudo
            return privilege.run(["kill", f"-{signum}", str(pid)], check=False)[0] == 0

    def link(self) -> HostLink:
        if self.ns is None:
            raise RuntimeError(f"{self.name} has no network namespace (loopback hosts)")
        if self._link is None:
            netns = self.ns.netns

            def run(argv: List[str], input_text: Optional[str] = None) -> Tuple[int, str]:
                return privilege.run(["ip", "netns", "exec", netns, *argv], check=False, input_text=input_text)

            self._link = HostLink(self.name, run)
        return self._link

    def release(self) -> None:
        if self._link is not None:  # the namespace outlives the run: leave it as it was
            with contextlib.suppress(RuntimeError):
                self._link.unblock()
                self._link.restore()
        if self.proc is not None:
            if self.proc.poll() is None:
                self._signal_all(signal.SIGCONT)
                self._signal_all(signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


class ProcessSubstrate:
    """Hosts as processes (module docstring). ``namespaces=None`` picks namespaces where the
    harness has root; True insists (an error says why it cannot), False never uses them."""

    kind = "processes"

    def __init__(self, run_dir: str, namespaces: Optional[bool] = None):
        self.run_dir = run_dir
        self.hosts_file = os.path.join(run_dir, "hosts")
        self.shared = os.path.join(run_dir, "shared")
        self.missing: Dict[str, str] = {}
        self.hosts: Dict[str, ProcessHost] = {}
        why = unavailable()
        if namespaces and why:
            raise RuntimeError(f"the process substrate with namespaces needs root: {why}")
        self.namespaced = why is None if namespaces is None else bool(namespaces)
        self.fabric: Optional[Fabric] = Fabric(os.path.basename(run_dir.rstrip("/"))[-8:]) if self.namespaced else None
        os.makedirs(self.shared, exist_ok=True)
        self._tmpfs = False
        self._filler: Optional[str] = None
        tmpfs_why = privilege.why_not()
        if tmpfs_why is None:
            code, out = privilege.run(["mount", "-t", "tmpfs", "-o", f"size={SHARED_MB}m,mode=1777", "tmpfs",
                                       self.shared], check=False)
            self._tmpfs = code == 0
            tmpfs_why = None if code == 0 else f"mount -t tmpfs fails here: {out.strip()[-200:]}"
        abilities = {"signals", "master"}
        if self.namespaced:
            abilities |= {"network", "names"}
            netem = netem_missing()
            if netem is None:
                abilities.add("netem")
            else:
                self.missing["netem"] = netem
        else:
            reason = why or "namespaces were turned off"
            for ability in ("network", "names", "netem"):
                self.missing[ability] = f"loopback hosts share one network stack and name ({reason})"
        if self._tmpfs:
            abilities |= {"disk", "readonly"}
        else:
            self.missing["disk"] = self.missing["readonly"] = f"the shared directory needs a tmpfs mount ({tmpfs_why})"
        self.abilities: FrozenSet[str] = frozenset(abilities)

    def interpreter(self) -> str:
        return sys.executable

    def python_paths(self, host: str) -> List[str]:
        """What leads every host's PYTHONPATH: the harness's sitecustomize."""
        return [SITE_DIR]

    def make_hosts(self, names: List[str]) -> Dict[str, ProcessHost]:
        made = {}
        for index, name in enumerate(names):
            if self.fabric is not None:
                number = name[4:] if name.startswith("node") else ""
                ns = self.fabric.add(name, 10 + int(number) if number.isdigit() else 2 + index)
                host = ProcessHost(name, ns.address, ns, self.hosts_file)
            else:
                host = ProcessHost(name, "127.0.0.1", None, None)
            made[name] = host
        self.hosts.update(made)
        return made

    def disk(self, state: str) -> str:
        if not self._tmpfs:
            raise RuntimeError(self.missing["disk"])
        return shared_disk(state, self)

    def close(self) -> None:
        for host in self.hosts.values():
            host.release()
        if self.fabric is not None:
            self.fabric.close()
        if self._tmpfs:
            privilege.run(["umount", "-l", self.shared], check=False)
            self._tmpfs = False


def shared_disk(state: str, sub: ProcessSubstrate) -> str:
    """Fill the shared tmpfs (a filler file up to ENOSPC), make it read-only, or undo both."""
    filler = os.path.join(sub.shared, ".distlib-testing-filler")
    if state == "full":
        privilege.run(["mount", "-o", "remount,rw", sub.shared])
        privilege.run(["sh", "-c", f'cat /dev/zero > "{filler}" 2>/dev/null; true'], timeout=60)
        return f"filled {sub.shared} (tmpfs, {SHARED_MB} MiB): writes now fail with ENOSPC"
    if state == "readonly":
        privilege.run(["mount", "-o", "remount,ro", sub.shared])
        return f"remounted {sub.shared} read-only: writes now fail with EROFS"
    privilege.run(["mount", "-o", "remount,rw", sub.shared])
    privilege.run(["rm", "-f", filler])
    return f"{sub.shared} writable again, filler removed"
