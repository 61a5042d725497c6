"""Loaded by every Python process the harness starts (its directory leads their PYTHONPATH).

It must work in any interpreter the job uses (a container's, a torch environment's), so it uses
the standard library only and imports nothing from distlib until the job does. It:

* registers faulthandler on SIGQUIT, writing every thread's stack to a file of the run
  directory, so that a run past its deadline can show where each process stood;
* tells the harness, over the run's UNIX socket, who this process is (node, pid, RANK), each
  collective it enters once the job imports distlib (``distlib.observers``), and the exception
  that ended it; at a collective the schedule names, it waits for the harness to say go, so the
  fault lands at that point in every run;
* with DISTLIB_TESTING_FAKE_GPUS=N, puts the CPU stand-in of CUDA and NCCL under cupy (the
  ``nccl`` backend then runs on CPU);
* then runs the sitecustomize its own would have shadowed, if there is one.

Nothing here may break the job: when the harness cannot be reached, the process runs on
unobserved (saying so once on stderr).
"""

import atexit
import faulthandler
import importlib.abc
import importlib.machinery
import io
import json
import os
import signal
import socket
import sys
import threading
import time

_ENV = os.environ
_HERE = os.path.dirname(os.path.abspath(__file__))
#: a gate's wait ends after this long even if the harness never answers (the harness's own
#: deadline is shorter; this only bounds a harness that died)
_GATE_LIMIT_S = 3600.0


class _Agent:
    """This process's connection to the harness, made at start-up (hello: who it is; the reply:
    the collective numbers at which it must wait for a go)."""

    def __init__(self, path):
        self._lock = threading.Lock()
        # no typing import here: this module runs at the start of every process of a job
        self._sock: socket.socket | None = None
        self._reader: io.BufferedReader | None = None
        self._gates: frozenset[int] = frozenset()
        self._count = 0
        self.rank = _int(_ENV.get("RANK"), -1)
        self.restart = _int(_ENV.get("TORCHELASTIC_RESTART_COUNT"), 0)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(30.0)
            sock.connect(path)
            self._sock, self._reader = sock, sock.makefile("rb")
            self._send({"kind": "hello", "argv": sys.argv[:8], "world": _int(_ENV.get("WORLD_SIZE"), -1)})
            self._gates = frozenset(json.loads(self._reader.readline() or b"{}").get("gates", ()))
            sock.settimeout(None)
        except (OSError, ValueError) as exc:
            self._sock = None
            sys.stderr.write(f"distlib.testing: cannot reach the harness at {path} ({exc}); "
                             f"this process runs unobserved\n")

    def _send(self, message):
        if self._sock is None:  # not connected (or the harness went away)
            return
        message.update(node=_ENV.get("DISTLIB_TESTING_NODE", "?"), pid=os.getpid(), rank=self.rank, t=time.time(),
                       restart=self.restart)
        self._sock.sendall(json.dumps(message).encode() + b"\n")

    def send(self, message, wait=False):
        with self._lock:
            if self._sock is None:
                return
            try:
                self._send(message)
                if wait and self._reader is not None:
                    self._sock.settimeout(_GATE_LIMIT_S)
                    self._reader.readline()  # "go" (or EOF: the harness is gone; go on)
                    self._sock.settimeout(None)
            except OSError:
                self._sock = None

    def collective(self, op_name):
        with self._lock:
            self._count += 1
            n = self._count
        gated = n in self._gates
        self.send({"kind": "collective", "n": n, "op": op_name, "gate": gated}, wait=gated)


def _int(text, default):
    try:
        return int(text)
    except (TypeError, ValueError):
        return default


def _report_exception(agent, previous):
    def hook(kind, value, tb):
        agent.send({"kind": "exception", "type": kind.__name__, "text": str(value)[:4000],
                    "bases": [c.__name__ for c in kind.__mro__[1:] if c is not object]})
        previous(kind, value, tb)
    return hook


class _ObserveDistlib(importlib.abc.MetaPathFinder):
    """Sets ``distlib.observers.collective_entered`` as soon as the job imports distlib."""

    def __init__(self, agent):
        self._agent = agent

    def find_spec(self, name, path=None, target=None):
        if name != "distlib.observers":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader, agent = spec.loader, self._agent
        run = loader.exec_module

        def exec_module(module):
            run(module)
            module.collective_entered = agent.collective

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this one loader's, on purpose
        return spec


def _stacks_file():
    folder = _ENV.get("DISTLIB_TESTING_STACKS")
    if not folder:
        return None
    try:
        return open(os.path.join(folder, f"{_ENV.get('DISTLIB_TESTING_NODE', 'node')}-{os.getpid()}.txt"), "w")
    except OSError:
        return None


def _install_fake_gpus(count):
    try:
        from distlib.testing.fake_gpu import install
    except ImportError as exc:
        sys.stderr.write(f"distlib.testing: DISTLIB_TESTING_FAKE_GPUS is set but the fake device cannot load ({exc})\n")
        return
    install(count)


def _chain():
    """Run the sitecustomize that ours shadows (Debian's python has one), if any."""
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and spec.origin != __file__:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _main():
    stacks = _stacks_file()
    if stacks is not None:
        faulthandler.register(signal.SIGQUIT, file=stacks, all_threads=True)
        globals()["_STACKS"] = stacks  # faulthandler keeps the descriptor, not the object
    path = _ENV.get("DISTLIB_TESTING_SOCKET")
    if path:
        agent = _Agent(path)
        sys.excepthook = _report_exception(agent, sys.excepthook)
        atexit.register(agent.send, {"kind": "exit"})
        sys.meta_path.insert(0, _ObserveDistlib(agent))
        globals()["_AGENT"] = agent
    gpus = _int(_ENV.get("DISTLIB_TESTING_FAKE_GPUS"), 0)
    if gpus > 0:
        _install_fake_gpus(gpus)


import importlib.util  # noqa: E402  (used by _chain)

_main()
_chain()
