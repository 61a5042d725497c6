"""The launcher behind ``distlib-run`` (``distlib run``): torchrun's flags, on distlib.

Modules, each small and testable on its own:

* ``conventions`` — what each cluster convention (torchrun's ``PET_*``, Kubeflow PyTorchJob v1,
  Kubernetes Indexed Jobs, LeaderWorkerSet, Volcano) says about the job, read from an
  environment dict; no decisions.
* ``resolve`` — ``resolve(flags, environ) -> Resolved``: the precedence rules (flags, then the
  environment, then defaults), validation and contradictions; a pure function.
* ``workerenv`` — the environment every worker gets (RANK, LOCAL_RANK, WORLD_SIZE, ...).
* ``master`` — the c10d master service: find it, or host it in-process when it should be on
  this machine; ``--node-rank auto`` through it.
* ``agent`` — spawns the workers, passes their output through, supervises them, stops them.
* ``report`` — the ``--dry-run`` text.

``distlib/run.py`` is the command line on top of these.
"""

from .resolve import Flags, Resolved, ResolveError, Value, resolve

__all__ = ["Flags", "Resolved", "ResolveError", "Value", "resolve"]
