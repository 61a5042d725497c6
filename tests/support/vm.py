"""Linux VMs under QEMU for the platform tests: the image, the VMs, their LAN, their cleanup.

The plumbing of the VM lane (tests/platforms; the NFS hosts, vm_nfs.py, are built on it):

* ``ensure_image()`` runs build-vm-image.sh: Debian's kernel and a debootstrap root, built
  once and cached under ~/.cache/distlib/<name>.
* ``Fleet`` boots VMs (QEMU system emulation, TCG: this kind of host's /dev/kvm boots no stock
  kernel) and kills every one of them when it closes. Each VM has two NICs: QEMU's user
  network, through which the host's loopback is 10.0.2.2 and the host reaches the guest's
  agent at a forwarded loopback port; and a LAN shared by the fleet's VMs: every VM's
  ``-netdev socket`` connects to ``Switch``, a learning Ethernet switch on 127.0.0.1 in this
  process. No VM has a default route: nothing outside can be addressed.
* ``VM.run(argv, timeout)`` / ``VM.python(code, timeout)`` run a command in the guest through
  its agent (guest/agent.py), with a deadline on both sides.

Nothing can leak: each QEMU runs in a process group of its own, dies with this process
(PR_SET_PDEATHSIG), is killed when its fleet closes, and leaves a pidfile in
~/.cache/distlib/vm-runs that the next fleet's ``sweep_orphans()`` uses to kill what a killed
test session left behind (only QEMUs whose command line carries this module's marker).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence

from tests.support import settings
from tests.fixtures.procfs import pid_alive

REPO_ROOT = Path(__file__).resolve().parents[2]
#: where it stays: the image's cache key hashes it, and the Makefile and docs name it
BUILD_SCRIPT = REPO_ROOT / "tests" / "platforms" / "build-vm-image.sh"
CACHE = Path(settings.cache_dir())
RUNS = CACHE / "vm-runs"
MARKER = "distlib-test-vm"
AGENT_PORT = 7000
LAN_PREFIX = "192.168.76."
BUILD_TIMEOUT_S = 1800
BOOT_TIMEOUT_S = 240.0
#: how much longer than a command's own timeout the host waits for the agent's answer: the
#: agent kills the command at its timeout, but an emulated guest under load answers late
ANSWER_SLACK_S = 60.0


class VMError(RuntimeError):
    """A VM did not boot, died, or did not answer in time; the message names the VM."""


# --- the image -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """A built image (build-vm-image.sh's directory and its image.env)."""

    directory: Path
    facts: Mapping[str, str]

    @property
    def qemu(self) -> str:
        return self.facts["QEMU"]

    @property
    def build_seconds(self) -> int:
        return int(self.facts.get("BUILD_SECONDS", "0"))


def ensure_image(name: str = "nfs-vm", log: Optional[Path] = None,
                 env: Optional[Mapping[str, str]] = None) -> Image:
    """The cached image ``name``, built first when missing (minutes, once). Raises VMError with
    the build log's tail when the build fails."""
    log = log or REPO_ROOT / ".build" / f"{name}-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "VM_IMAGE_NAME": name, **(env or {})}
    with open(log, "ab") as out:
        try:
            done = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=out,
                                  stdin=subprocess.DEVNULL, env=full_env, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise VMError(f"building the VM image {name} ran past {BUILD_TIMEOUT_S} s (log: {log})") from None
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
        raise VMError(f"building the VM image {name} failed (exit {done.returncode}; log: {log}):\n{tail}")
    directory = Path(done.stdout.decode().strip().splitlines()[-1])
    facts = {}
    for line in (directory / "image.env").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            facts[key] = value
    return Image(directory, facts)


# --- the LAN -----------------------------------------------------------------------------------------


class Switch:
    """A learning Ethernet switch for QEMU's ``-netdev socket,connect=127.0.0.1:PORT``: frames
    are a 4-byte big-endian length and the frame. A frame goes to the port that last sent from
    its destination MAC, else to every other port (broadcast, unknown unicast). One thread."""

    def __init__(self):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.buffers: Dict[socket.socket, bytearray] = {}
        self.where: Dict[bytes, socket.socket] = {}
        self.closing = False
        self.thread = threading.Thread(target=self._loop, name="vm-switch", daemon=True)
        self.thread.start()

    def connected(self) -> int:
        """How many ports are connected (accepted by the switch's thread)."""
        return len(self.buffers)

    def _drop(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        self.buffers.pop(conn, None)
        for mac in [m for m, c in self.where.items() if c is conn]:
            del self.where[mac]
        conn.close()

    def _send(self, conn: socket.socket, data: bytes) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(1.0)  # a stuck VM loses its frames, it does not stop the LAN
            conn.sendall(data)
        except OSError:
            self._drop(conn)
        finally:
            with contextlib.suppress(OSError):
                conn.setblocking(False)

    def _forward(self, source: socket.socket, frame: bytes) -> None:
        if len(frame) >= 12:
            self.where[frame[6:12]] = source
        data = len(frame).to_bytes(4, "big") + frame
        target = self.where.get(frame[0:6])
        ports = [target] if target is not None and target is not source else \
            [c for c in self.buffers if c is not source]
        for conn in ports:
            self._send(conn, data)

    def _loop(self) -> None:
        while not self.closing:
            for key, _ in self.selector.select(timeout=0.5):
                sock = key.fileobj
                if sock is self.listener:
                    with contextlib.suppress(OSError):
                        conn, _ = self.listener.accept()
                        conn.setblocking(False)
                        self.buffers[conn] = bytearray()
                        self.selector.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    chunk = sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    self._drop(sock)
                    continue
                buf = self.buffers.get(sock)
                if buf is None:
                    continue
                buf += chunk
                while len(buf) >= 4:
                    size = int.from_bytes(buf[:4], "big")
                    if len(buf) < 4 + size:
                        break
                    frame = bytes(buf[4:4 + size])
                    del buf[:4 + size]
                    self._forward(sock, frame)

    def close(self) -> None:
        self.closing = True
        self.thread.join(timeout=5)
        for conn in list(self.buffers):
            self._drop(conn)
        self.listener.close()
        self.selector.close()


# --- one VM ------------------------------------------------------------------------------------------


@dataclass
class Result:
    """What a command in a VM did."""

    vm: str
    argv: Sequence[str]
    rc: int
    out: str
    err: str
    seconds: float
    timed_out: bool

    def check(self) -> "Result":
        """Itself when the command exited 0; VMError with its output otherwise."""
        if self.rc != 0 or self.timed_out:
            what = f"ran past its timeout ({self.seconds:.1f} s)" if self.timed_out else f"exited {self.rc}"
            raise VMError(f"{self.vm}: {shlex.join(self.argv)[:300]} {what}\n--- stdout\n{self.out[-3000:]}"
                          f"\n--- stderr\n{self.err[-3000:]}")
        return self


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # in the child, before exec: SIGKILL when the test process dies
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class VM:
    """One booted VM; built by Fleet.boot."""

    name: str
    index: int
    lan_address: str
    agent_port: int
    console: Path
    process: subprocess.Popen
    pidfile: Path
    booted_in: float = 0.0
    env: Dict[str, str] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.process.poll() is None

    def console_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.console.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no console log)"

    def _connect(self, timeout: float) -> socket.socket:
        """A connection to the agent, past its hello; VMError when none within ``timeout``."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            if not self.alive():
                raise VMError(f"VM {self.name} is not running (QEMU exited {self.process.returncode}); "
                              f"console:\n{self.console_tail()}")
            sock = socket.socket()
            try:
                sock.settimeout(max(0.5, min(5.0, deadline - time.monotonic())))
                sock.connect(("127.0.0.1", self.agent_port))
                line = sock.makefile("rb").readline()
                if line and json.loads(line).get("hello") == self.name:
                    return sock
                last = f"greeting {line[:80]!r}"  # QEMU accepts, then closes while the guest does not listen
            except (OSError, ValueError) as exc:
                last = repr(exc)
            sock.close()
            if time.monotonic() >= deadline:
                raise VMError(f"VM {self.name}: its agent (127.0.0.1:{self.agent_port}) did not answer within "
                              f"{timeout:.0f} s ({last}); console:\n{self.console_tail()}")
            time.sleep(0.3)

    def run(self, argv: Sequence[str], timeout: float = 60.0, env: Optional[Mapping[str, str]] = None,
            input: str = "", cwd: str = "/") -> Result:
        """Run ``argv`` in the guest, killed there after ``timeout`` s. VMError when the VM dies or
        its agent does not answer within ``timeout`` + ANSWER_SLACK_S."""
        started = time.monotonic()
        sock = self._connect(30.0)
        request = {"argv": list(argv), "env": {**self.env, **(env or {})}, "timeout": timeout, "input": input,
                   "cwd": cwd}
        with sock:
            sock.settimeout(timeout + ANSWER_SLACK_S)
            try:
                sock.sendall(json.dumps(request).encode() + b"\n")
                line = sock.makefile("rb").readline()
            except socket.timeout:
                raise VMError(f"VM {self.name}: no answer to {shlex.join(argv)[:200]} within "
                              f"{timeout + ANSWER_SLACK_S:.0f} s (its timeout {timeout:.0f} s + slack)") from None
            except OSError as exc:
                line = b""
                why = repr(exc)
            else:
                why = "the connection closed"
        if not line:
            state = "running" if self.alive() else f"powered off (QEMU exited {self.process.returncode})"
            raise VMError(f"VM {self.name}: no answer to {shlex.join(argv)[:200]} after "
                          f"{time.monotonic() - started:.1f} s ({why}; the VM is {state})")
        answer = json.loads(line)
        return Result(self.name, list(argv), answer["rc"], answer["out"], answer["err"], answer["seconds"],
                      answer["timed_out"])

    def sh(self, script: str, timeout: float = 60.0, env: Optional[Mapping[str, str]] = None) -> Result:
        return self.run(["/bin/sh", "-c", script], timeout=timeout, env=env)

    def python(self, code: str, timeout: float = 60.0, env: Optional[Mapping[str, str]] = None,
               args: Sequence[str] = ()) -> Result:
        """``python3 -c code args...`` in the guest, distlib importable from the working tree."""
        return self.run(["python3", "-c", code, *args], timeout=timeout, env=env)

    def spawn(self, argv: Sequence[str], name: str, env: Optional[Mapping[str, str]] = None) -> None:
        """Start ``argv`` in the background of the guest (it outlives the request); its output
        goes to /tmp/<name>.out and /tmp/<name>.err there."""
        self.run(["/bin/sh", "-c", f"nohup {shlex.join(argv)} >/tmp/{name}.out 2>/tmp/{name}.err </dev/null &"],
                 timeout=30, env=env).check()

    def freeze(self) -> None:
        """Stop the VM's QEMU (SIGSTOP): the guest stands still, as a host stalled by swapping or
        a hung hypervisor, and misses every lease and grace period until ``thaw``."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def power_off(self) -> None:
        """Pull the plug: QEMU is killed, the guest gets no chance to say goodbye (no NFS
        unlock, no TCP FIN)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        with contextlib.suppress(FileNotFoundError):
            self.pidfile.unlink()


# --- the fleet -------------------------------------------------------------------------------------------


def _qemu_of_ours(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(MARKER.encode() in part for part in cmdline)


def sweep_orphans() -> List[str]:
    """Kill the QEMUs that test sessions which are gone left behind (their pidfiles); names them."""
    killed = []
    if not RUNS.is_dir():
        return killed
    for pidfile in RUNS.glob("*.pid"):
        try:
            qemu_pid, owner_pid, name = pidfile.read_text().split()[:3]
            qemu_pid, owner_pid = int(qemu_pid), int(owner_pid)
        except (OSError, ValueError):
            continue
        if pid_alive(owner_pid):
            continue
        if _qemu_of_ours(qemu_pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(qemu_pid, signal.SIGKILL)
            killed.append(f"{name} (pid {qemu_pid})")
        with contextlib.suppress(FileNotFoundError):
            pidfile.unlink()
    return killed


class Fleet:
    """VMs of one image on one LAN (192.168.76.0/24); a context manager that kills them all."""

    def __init__(self, image: Image, memory_mb: int = 384, log_dir: Optional[Path] = None):
        self.image = image
        self.memory_mb = memory_mb
        self.log_dir = log_dir or REPO_ROOT / ".build" / "vm-logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.pyc_dir = image.directory.parent / "pyc"
        self.pyc_dir.mkdir(exist_ok=True)
        self.switch = Switch()
        self.vms: List[VM] = []
        self.hosts: Dict[str, str] = {}
        swept = sweep_orphans()
        if swept:
            print(f"[vm] killed VMs left by dead test sessions: {', '.join(swept)}")

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def plan(self, names: Sequence[str]) -> None:
        """Reserve LAN addresses for ``names`` (every VM's /etc/hosts lists the planned ones)."""
        for name in names:
            if name not in self.hosts:
                self.hosts[name] = f"{LAN_PREFIX}{10 + len(self.hosts)}"

    def start(self, name: str, extra_args: Sequence[str] = ()) -> VM:
        """Start QEMU for ``name`` (planned or not); VM.wait_booted / boot() wait for the agent."""
        self.plan([name])
        index = list(self.hosts).index(name)
        address = self.hosts[name]
        port = _free_port()
        console = self.log_dir / f"{name}-{os.getpid()}.console"
        hosts = ",".join(f"{n}={a}" for n, a in self.hosts.items())
        append = (f"console=ttyS0 panic=-1 loglevel=4 ipv6.disable=1 mitigations=off random.trust_cpu=on tsc=reliable "
                  f"no_timer_check distlib.name={name} distlib.lan={address}/24 distlib.hosts={hosts}")
        argv = [
            self.image.qemu, "-name", f"{MARKER}:{name},process={MARKER}-{name}",
            "-accel", "tcg,thread=single,tb-size=128", "-cpu", "max", "-smp", "1", "-m", str(self.memory_mb),
            "-nographic", "-no-reboot", "-nodefaults", "-serial", f"file:{console}", "-monitor", "none",
            "-kernel", str(self.image.directory / "vmlinux"), "-initrd", str(self.image.directory / "initrd.img"),
            "-append", append,
            "-drive", f"file={self.image.directory / 'root.img'},if=virtio,format=raw,snapshot=on",
            "-virtfs", f"local,path={REPO_ROOT},mount_tag=src,security_model=none,readonly=on",
            "-virtfs", f"local,path={self.pyc_dir},mount_tag=pyc,security_model=none",
            "-netdev", f"user,id=user,net=10.0.2.0/24,ipv6=off,hostfwd=tcp:127.0.0.1:{port}-10.0.2.15:{AGENT_PORT}",
            "-device", f"virtio-net-pci,netdev=user,mac=52:54:00:00:00:{index:02x},romfile=",
            "-netdev", f"socket,id=lan,connect=127.0.0.1:{self.switch.port}",
            "-device", f"virtio-net-pci,netdev=lan,mac=52:54:00:4c:00:{index:02x},romfile=",
            *extra_args,
        ]
        env = dict(os.environ)
        if self.image.facts.get("QEMU_LIBS"):
            env["LD_LIBRARY_PATH"] = self.image.facts["QEMU_LIBS"]
        if self.image.facts.get("QEMU_DATA"):
            argv[1:1] = ["-L", self.image.facts["QEMU_DATA"]]
        stderr = open(self.log_dir / f"{name}-{os.getpid()}.qemu.log", "wb")
        process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                                   start_new_session=True, preexec_fn=_die_with_parent)
        stderr.close()
        RUNS.mkdir(parents=True, exist_ok=True)
        pidfile = RUNS / f"{process.pid}.pid"
        pidfile.write_text(f"{process.pid} {os.getpid()} {name}\n")
        vm = VM(name, index, address, port, console, process, pidfile)
        vm.started = time.monotonic()  # type: ignore[attr-defined]
        self.vms.append(vm)
        return vm

    def boot(self, names: Sequence[str], timeout: float = BOOT_TIMEOUT_S) -> List[VM]:
        """Start the VMs ``names`` side by side and wait until each agent answers."""
        self.plan(names)
        vms = [self.start(name) for name in names]
        for vm in vms:
            vm._connect(max(1.0, vm.started + timeout - time.monotonic())).close()  # type: ignore[attr-defined]
            vm.booted_in = time.monotonic() - vm.started  # type: ignore[attr-defined]
        return vms

    def close(self) -> None:
        for vm in self.vms:
            vm.power_off()
        self.vms.clear()
        self.switch.close()


@contextlib.contextmanager
def fleet(image: Image, **kwargs) -> Iterator[Fleet]:
    with Fleet(image, **kwargs) as f:
        yield f
