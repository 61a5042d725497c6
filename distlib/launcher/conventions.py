"""What each cluster convention says about the job, read from an environment dict.

Cluster managers tell a pod who it is through environment variables, each in its own
dialect. This module only *reads* them: every function takes an environment mapping and
returns a ``Convention`` whose ``candidates`` give, per launcher setting, the raw text and
the variable(s) it came from. Which candidate wins is ``resolve.py``'s business; nothing here
looks at flags or decides.

Settings (the ``field`` of a candidate): ``nnodes``, ``nproc_per_node``, ``node_rank``,
``master_addr``, ``master_port``, ``rdzv_backend``, ``rdzv_endpoint``, ``run_id``.

The conventions, in the order ``resolve`` consults them (docs/launcher.md has the table):

* **torchrun ``PET_*``** — torchrun reads every flag's default from ``PET_<FLAG>``
  (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
  ``PET_MASTER_PORT``, ``PET_RDZV_BACKEND``, ``PET_RDZV_ENDPOINT``, ``PET_RDZV_ID``). Kubeflow
  Trainer sets them, and so does the v1 training operator (PyTorchJob) from v1.7 on.
* **pod-level RANK/WORLD_SIZE** — Kubeflow PyTorchJob v1 (and Volcano's pytorch plugin) set
  ``RANK`` to the *pod's* rank (master 0, worker i → i+1) while ``WORLD_SIZE`` counts pods
  (operator before v1.7, Volcano) or *processes*, pods × ``PET_NPROC_PER_NODE`` (v1.7 on,
  when that value is an integer; the operator counts 1 per pod otherwise). Read naively, as a
  process rank and world size, they are wrong whenever a pod runs several processes: the
  trap. Only read when ``LOCAL_RANK`` is absent (with it, they come from an outer launcher).
* **MASTER_ADDR/MASTER_PORT** in the launcher's own environment (set by the same operators,
  or by hand).
* **run id variables** — ``DISTLIB_RUN_ID`` (the Helm chart), ``TORCHELASTIC_RUN_ID``.
* **Slurm** — inside an ``srun`` step (distlib/slurm/step.py reads the variables): with one
  task per node (``srun --ntasks-per-node=1 distlib-run ...``), ``SLURM_NNODES`` nodes and
  node rank ``SLURM_NODEID``; the first host of ``SLURM_STEP_NODELIST`` as master address,
  the port from the job and step ids, the run id ``slurm-<job>.<step>``. With several tasks on
  a node every task would start its own launcher there: the node count and rank are errors
  that say so (unless given as flags).
* **LeaderWorkerSet** — ``LWS_LEADER_ADDRESS`` (the leader pod's DNS name),
  ``LWS_GROUP_SIZE`` (pods in the group), ``LWS_WORKER_INDEX`` (0 for the leader). Each group
  is its own job, so the leader's address also serves as a run id the group agrees on.
* **Kubernetes Indexed Job** — ``JOB_COMPLETION_INDEX`` gives the node rank only: the pod is
  not told the number of completions nor pod 0's address.
* **Volcano** — the env plugin's ``VC_TASK_INDEX`` (also ``VK_TASK_INDEX``: the pod's index
  within its task) and the svc plugin's ``VC_<TASK>_HOSTS`` (comma-separated pod DNS names)
  and ``VC_<TASK>_NUM`` (``<TASK>`` upper-cased, ``-`` turned into ``_``). With one task the
  node rank is the task index; with several (e.g. master + worker) the tasks are laid end to
  end, MASTER first, then by name, and a pod finds itself by its host name in that list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from ..settings import launcher_run_id
from ..slurm import step as slurm_step

FIELDS = ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port",
          "rdzv_backend", "rdzv_endpoint", "run_id")


@dataclass(frozen=True)
class Candidate:
    """One convention's answer for one setting: raw text and where it came from.

    ``error`` replaces ``value`` when the convention's variables are present but cannot give a
    value (e.g. WORLD_SIZE not divisible); it is raised only if this candidate is the one used.
    """

    field: str
    value: Optional[str]
    source: str
    convention: str
    error: Optional[str] = None

    @property
    def text(self) -> str:
        """``value``, for a candidate without an error (which always has one)."""
        if self.value is None:
            raise ValueError(f"{self.field} from {self.source}: {self.error or 'no value'}")
        return self.value


@dataclass
class Convention:
    name: str
    candidates: Dict[str, Candidate] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def add(self, field_name: str, value: Optional[str], source: str, error: Optional[str] = None) -> None:
        self.candidates[field_name] = Candidate(field_name, value, source, self.name, error)

    def __bool__(self) -> bool:
        return bool(self.candidates or self.notes)


def _get(env: Mapping[str, str], name: str) -> Optional[str]:
    """The variable's value, stripped; empty counts as unset (as torch's env:// reads it)."""
    value = env.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def _int(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


# -- torchrun's PET_* ----------------------------------------------------------------------------

PET = "torchrun PET_*"
PET_VARS = {
    "nnodes": "PET_NNODES",
    "nproc_per_node": "PET_NPROC_PER_NODE",
    "node_rank": "PET_NODE_RANK",
    "master_addr": "PET_MASTER_ADDR",
    "master_port": "PET_MASTER_PORT",
    "rdzv_backend": "PET_RDZV_BACKEND",
    "rdzv_endpoint": "PET_RDZV_ENDPOINT",
    "run_id": "PET_RDZV_ID",
}


def torchrun_pet(env: Mapping[str, str]) -> Convention:
    conv = Convention(PET)
    for name, var in PET_VARS.items():
        value = _get(env, var)
        if value is not None:
            conv.add(name, value, var)
    return conv


# -- Kubeflow PyTorchJob v1 / Volcano pytorch plugin: pod-level RANK and WORLD_SIZE ---------------

POD_RANK = "pod-level RANK/WORLD_SIZE (Kubeflow PyTorchJob v1, Volcano pytorch plugin)"


def pod_rank(env: Mapping[str, str]) -> Convention:
    conv = Convention(POD_RANK)
    rank, world = _get(env, "RANK"), _get(env, "WORLD_SIZE")
    if rank is None or world is None:
        return conv
    if _get(env, "LOCAL_RANK") is not None:
        conv.notes.append(
            f"RANK={rank} and WORLD_SIZE={world} ignored: LOCAL_RANK is set too, so they are process "
            "ranks from an outer launcher, not a pod's rank (is distlib-run running inside another "
            "launcher's worker?)")
        return conv
    rank_number = _int(rank)
    if rank_number is None or rank_number < 0:
        conv.add("node_rank", None, "RANK", f"RANK={rank!r} is not a non-negative integer")
    else:
        conv.add("node_rank", rank, "RANK (the pod's rank)")
    world_n = _int(world)
    pet_nproc = _get(env, "PET_NPROC_PER_NODE")
    procs = _int(pet_nproc)
    if world_n is None or world_n < 1:
        conv.add("nnodes", None, "WORLD_SIZE", f"WORLD_SIZE={world!r} is not a positive integer")
    elif procs is not None and procs >= 1:
        source = f"WORLD_SIZE={world_n} / PET_NPROC_PER_NODE={procs} (WORLD_SIZE counts processes)"
        if world_n % procs:
            conv.add("nnodes", None, source,
                     f"WORLD_SIZE={world_n} is not divisible by PET_NPROC_PER_NODE={procs}: the Kubeflow "
                     "training operator (v1.7+) sets WORLD_SIZE to pods x nprocPerNode, so this environment "
                     "contradicts itself; pass --nnodes explicitly")
        else:
            conv.add("nnodes", str(world_n // procs), source)
    else:
        why = "no PET_NPROC_PER_NODE" if pet_nproc is None else f"PET_NPROC_PER_NODE={pet_nproc} is not an integer"
        conv.add("nnodes", str(world_n), f"WORLD_SIZE={world_n} (counts pods: {why})")
    return conv


# -- MASTER_ADDR / MASTER_PORT in the launcher's environment ---------------------------------------

MASTER_ENV = "MASTER_ADDR/MASTER_PORT"


def master_env(env: Mapping[str, str]) -> Convention:
    conv = Convention(MASTER_ENV)
    for name, var in (("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT")):
        value = _get(env, var)
        if value is not None:
            conv.add(name, value, var)
    return conv


# -- run id variables ------------------------------------------------------------------------------

RUN_ID_ENV = "run id variables"


def run_id_env(env: Mapping[str, str]) -> Convention:
    conv = Convention(RUN_ID_ENV)
    found = launcher_run_id(env)
    if found is not None:
        var, value = found
        conv.add("run_id", value, var)
    return conv


# -- Slurm ---------------------------------------------------------------------------------------

SLURM = "Slurm (srun)"


def _add_reading(conv: Convention, field_name: str, reading: slurm_step.Reading, note: str = "") -> None:
    if reading.error:
        conv.add(field_name, None, reading.source or "Slurm's variables",
                 f"{reading.error} (Slurm's variables of this srun task)")
    elif reading.value is not None:
        conv.add(field_name, str(reading.value), reading.source + note)


def slurm(env: Mapping[str, str]) -> Convention:
    conv = Convention(SLURM)
    if not slurm_step.in_step(env):
        hint = slurm_step.outside_step_hint(env)
        if hint:
            conv.notes.append("Slurm's variables not read" + hint)
        return conv
    step = slurm_step.Step(env)
    shape = step.one_task_per_node
    if shape.error or shape.value is not False:
        _add_reading(conv, "nnodes", shape if shape.error else step.nnodes, " (one distlib-run per node)")
        _add_reading(conv, "node_rank", shape if shape.error else step.node_rank)
    else:
        text = (f"this srun step runs several tasks on a node ({shape.source}), so each would start its own "
                "distlib-run there: start one per node (srun --ntasks-per-node=1 distlib-run --nproc-per-node N "
                "...), or run the script itself as the step's tasks (srun python train.py); or pass --nnodes "
                "and --node-rank")
        conv.add("nnodes", None, shape.source, text)
        conv.add("node_rank", None, shape.source, text)
    _add_reading(conv, "master_addr", step.master_addr)
    _add_reading(conv, "master_port", step.master_port)
    _add_reading(conv, "run_id", step.run_id)
    return conv


# -- LeaderWorkerSet ------------------------------------------------------------------------------

LWS = "LeaderWorkerSet"


def leader_worker_set(env: Mapping[str, str]) -> Convention:
    conv = Convention(LWS)
    leader = _get(env, "LWS_LEADER_ADDRESS")
    size = _get(env, "LWS_GROUP_SIZE")
    index = _get(env, "LWS_WORKER_INDEX")
    if leader is None and size is None and index is None:
        return conv
    if size is not None:
        conv.add("nnodes", size, "LWS_GROUP_SIZE")
    if index is not None:
        conv.add("node_rank", index, "LWS_WORKER_INDEX")
    if leader is not None:
        conv.add("master_addr", leader, "LWS_LEADER_ADDRESS")
        conv.add("run_id", f"lws-{leader}", "LWS_LEADER_ADDRESS (one id per LWS group)")
    return conv


# -- Kubernetes Indexed Job -----------------------------------------------------------------------

INDEXED_JOB = "Kubernetes Indexed Job"


def indexed_job(env: Mapping[str, str]) -> Convention:
    conv = Convention(INDEXED_JOB)
    index = _get(env, "JOB_COMPLETION_INDEX")
    if index is not None:
        conv.add("node_rank", index, "JOB_COMPLETION_INDEX")
    return conv


# -- Volcano --------------------------------------------------------------------------------------

VOLCANO = "Volcano"
_HOSTS = re.compile(r"VC_(.+)_HOSTS")
_NUM = re.compile(r"VC_(.+)_NUM")


def _volcano_tasks(env: Mapping[str, str]) -> List[Tuple[str, List[str], Optional[str]]]:
    """[(TASK, hosts, VC_<TASK>_NUM text)], MASTER first, then by name."""
    tasks = {}
    for key in env:
        match = _HOSTS.fullmatch(key)
        if match:
            hosts = [h.strip() for h in env[key].split(",") if h.strip()]
            tasks[match.group(1)] = (hosts, _get(env, f"VC_{match.group(1)}_NUM"))
    order = sorted(tasks, key=lambda t: (t != "MASTER", t))
    return [(t, tasks[t][0], tasks[t][1]) for t in order]


def _label(host: str) -> str:
    return host.split(".", 1)[0].lower()


def volcano(env: Mapping[str, str], hostname: Optional[str] = None) -> Convention:
    conv = Convention(VOLCANO)
    index_var = "VC_TASK_INDEX" if _get(env, "VC_TASK_INDEX") is not None else "VK_TASK_INDEX"
    index = _get(env, index_var)
    tasks = _volcano_tasks(env)
    if not tasks:
        if index is not None:
            conv.add("node_rank", index, index_var)
        return conv
    all_hosts: List[str] = []
    for _task, hosts, _num in tasks:
        all_hosts.extend(hosts)
    names = [f"VC_{t}_HOSTS" for t, _, _ in tasks]
    if len(tasks) == 1:
        task, hosts, num = tasks[0]
        if num is not None:
            conv.add("nnodes", num, f"VC_{task}_NUM")
        elif hosts:
            conv.add("nnodes", str(len(hosts)), f"the number of hosts in VC_{task}_HOSTS")
    else:
        nums = [_int(num) if num is not None else len(hosts) for _, hosts, num in tasks]
        known = [n for n in nums if n is not None]
        if len(known) == len(nums):
            conv.add("nnodes", str(sum(known)), " + ".join(f"VC_{t}_NUM" for t, _, _ in tasks))
    if all_hosts:
        conv.add("master_addr", all_hosts[0], f"the first host of {names[0]}")
    me = _label(hostname) if hostname else None
    position = next((i for i, h in enumerate(all_hosts) if me and _label(h) == me), None)
    if len(tasks) == 1 and index is not None:
        conv.add("node_rank", index, index_var)
    elif position is not None:
        conv.add("node_rank", str(position), f"the position of host {hostname!r} in {','.join(names)}")
    elif len(tasks) > 1:
        conv.add("node_rank", None, ",".join(names),
                 f"Volcano job with several tasks ({', '.join(t for t, _, _ in tasks)}) and this pod's host "
                 f"name {hostname!r} is in none of {', '.join(names)}: cannot tell its node rank; pass --node-rank")
    return conv


# -- all of them, in precedence order --------------------------------------------------------------

def read_all(env: Mapping[str, str], hostname: Optional[str] = None) -> List[Convention]:
    """Every convention's reading of ``env``, highest precedence first (empty ones included)."""
    return [
        torchrun_pet(env),
        pod_rank(env),
        master_env(env),
        run_id_env(env),
        slurm(env),
        leader_worker_set(env),
        indexed_job(env),
        volcano(env, hostname),
    ]
