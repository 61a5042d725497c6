"""Slurm's environment, read for torch's names: what ``srun`` tells each task.

* ``hostlist`` — Slurm's host list syntax (``node[01-04,7]``), expanded;
* ``step`` — the task's rank, world size, node, local rank, master address and port and
  run id, from the variables ``srun`` sets, each with the variables it came from.

Pure functions of an environment mapping, at the bottom layer: the env:// init method
(distlib/rendezvous.py) and the launcher's conventions (distlib/launcher/conventions.py) both
read them. docs/launcher.md ("Slurm") says what is read and the port rule.
"""
