"""What the cluster runs on its hosts: a script, a module, a function, or a launcher.

A ``Job`` says what one host runs and which environment each gets. Plain jobs (script, module,
function) run one rank per host with torch's env:// variables; the master service the harness
runs is their store (``TORCHELASTIC_USE_AGENT_STORE=True``, which torch and distlib both read:
rank 0 is a client like the others), which is where the harness sees what torch jobs do too.
Launched jobs run ``distlib-run`` (or torch's ``torchrun``) on every host with the c10d
rendezvous at the master service, elastic with ``nnodes="MIN:MAX"``.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from .settings import FAKE_GPUS

MASTER_PORT = 29500
LAUNCHERS = {"distlib-run": ["-m", "distlib.run"], "torchrun": ["-m", "torch.distributed.run"]}


@dataclass
class Job:
    """Build one with ``Job.script``, ``Job.module``, ``Job.function`` or ``Job.launch``."""

    program: List[str]                     # what follows the interpreter: script path / -m module, args
    env: Dict[str, str] = field(default_factory=dict)
    launcher: Optional[str] = None         # None: one rank per host
    nproc_per_node: int = 1
    nnodes: Optional[str] = None           # launched jobs: "3" or "2:3"
    max_restarts: int = 0
    rdzv_conf: Optional[str] = None
    rdzv_endpoint: Optional[str] = None    # default: the master service
    launcher_args: Sequence[str] = ()     # more flags for the launcher (e.g. --rdzv-timeout 60)
    run_id: str = "job"
    fake_gpus: int = 0
    python: Optional[str] = None           # the interpreter on the hosts (default: the substrate's)
    fn: Optional[Callable[..., Any]] = None    # Job.function's function
    function_args: Sequence[Any] = ()

    # --- constructors -------------------------------------------------------------------------

    @classmethod
    def script(cls, path: str, *args: str, env: Optional[Dict[str, str]] = None, **options: Any) -> "Job":
        """``python path args...`` on every host (path relative to the project directory)."""
        return cls([str(path), *map(str, args)], dict(env or {}), **options)

    @classmethod
    def module(cls, name: str, *args: str, env: Optional[Dict[str, str]] = None, **options: Any) -> "Job":
        """``python -m name args...`` on every host."""
        return cls(["-m", name, *map(str, args)], dict(env or {}), **options)

    @classmethod
    def function(cls, fn: Callable[..., Any], *args: Any, env: Optional[Dict[str, str]] = None,
                 **options: Any) -> "Job":
        """``fn(*args)`` on every rank (a module-level function: it is imported there by name);
        its return value is in the rank's record (``value``)."""
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if not module or "<locals>" in qualname or "<lambda>" in qualname:
            raise ValueError(f"Job.function needs a module-level function (imported by name on each rank), "
                             f"not {fn!r}")
        return cls(["-m", "distlib.testing.function_rank", f"{module}:{qualname}"], dict(env or {}),
                   fn=fn, function_args=tuple(args), **options)

    @classmethod
    def launch(cls, program: Sequence[str], *, nnodes: Optional[str] = None, nproc_per_node: int = 1,
               max_restarts: int = 0, rdzv_conf: Optional[str] = None, rdzv_endpoint: Optional[str] = None,
               launcher: str = "distlib-run", launcher_args: Sequence[str] = (),
               env: Optional[Dict[str, str]] = None, **options: Any) -> "Job":
        """``distlib-run`` (or ``launcher="torchrun"``) on every host, with the c10d rendezvous
        at the master service: ``program`` is what follows the launcher's flags (a script and
        its arguments, or ``["-m", module, ...]``). ``nnodes="2:3"`` makes it elastic;
        ``rdzv_endpoint`` replaces the master service (e.g. ``file://<shared>/rdzv``: the rounds
        on a FileStore); ``launcher_args`` are further launcher flags."""
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, not {launcher!r}")
        return cls([*map(str, program)], dict(env or {}), launcher=launcher, nnodes=nnodes,
                   nproc_per_node=nproc_per_node, max_restarts=max_restarts, rdzv_conf=rdzv_conf,
                   rdzv_endpoint=rdzv_endpoint, launcher_args=tuple(map(str, launcher_args)), **options)

    # --- what each host runs ------------------------------------------------------------------

    def world_size(self, hosts: int) -> int:
        return hosts * self.nproc_per_node

    def argv(self, python: str, hosts: int) -> List[str]:
        if self.launcher is None:
            return [python, "-u", *self.program]
        flags = ["--nnodes", self.nnodes or str(hosts), "--nproc-per-node", str(self.nproc_per_node),
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint or f"master:{MASTER_PORT}", "--run-id", self.run_id,
                 "--max-restarts", str(self.max_restarts), "--log-line-prefix-template", "[rank${rank}]: "]
        if self.rdzv_conf:
            flags += ["--rdzv-conf", self.rdzv_conf]
        flags += list(self.launcher_args)
        return [python, "-u", *LAUNCHERS[self.launcher], *flags, *self.program]

    def host_env(self, index: int, hosts: int, master_addr: str, master_port: int) -> Dict[str, str]:
        env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
        if self.launcher is None:
            env.update(RANK=str(index), WORLD_SIZE=str(hosts), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       GROUP_RANK=str(index), NODE_RANK=str(index), TORCHELASTIC_USE_AGENT_STORE="True",
                       DISTLIB_EXTERNAL_STORE="1")
        if self.fake_gpus:
            env[FAKE_GPUS] = str(self.fake_gpus)
        env.update(self.env)
        return env

    def write_inputs(self, run_dir: str) -> None:
        """A function job's arguments, for the ranks to read."""
        if self.fn is not None:
            Path(run_dir, "function-args.pkl").write_bytes(pickle.dumps(tuple(self.function_args)))

    def describe(self) -> str:
        what = " ".join(self.program)
        return f"{self.launcher} {what}" if self.launcher else what
