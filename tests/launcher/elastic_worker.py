"""The worker of the elastic launcher tests: joins the round's group, records what it was told,
runs collectives for a while, and misbehaves on request.

Environment (besides distlib-run's):

* ``EW_OUT``: a directory; each worker writes ``<restart count>-<rank>.json`` there: its
  torchrun variables, the sum of an all_reduce of ones (= the world size when the group is
  whole), and the host/pid of its agent.
* ``EW_STEPS`` (default 20), ``EW_STEP_S`` (default 0.05): all_reduces, and the pause after each.
* ``EW_CRASH``: ``ROUND:RANK`` pairs (``0:2,1:0``); that worker exits with status 3 after its
  first all_reduce. ``*`` for the round crashes in every round.
* ``EW_MARK``: a directory where each worker writes ``started-<restart count>-<rank>`` (holding its
  agent's pid) once its first all_reduce is done: tests wait on it instead of sleeping.
"""

import json
import os
import sys
import time

import numpy as np

import distlib as dist
from distlib_deploy.jobs import _common


def crashes(spec: str, round_: int, rank: int) -> bool:
    for item in filter(None, spec.split(",")):
        r, _, k = item.partition(":")
        if (r == "*" or int(r) == round_) and int(k) == rank:
            return True
    return False


def main() -> int:
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    _common.join("gloo", 30.0)
    rank = dist.get_rank()
    steps = int(os.environ.get("EW_STEPS", "20"))
    pause = float(os.environ.get("EW_STEP_S", "0.05"))
    total = None
    for step in range(steps):
        x = np.ones(4, np.float32)
        dist.all_reduce(x)
        total = float(x[0])
        if step == 0:
            mark = os.environ.get("EW_MARK")
            if mark:
                with open(os.path.join(mark, f"started-{restart}-{rank}.tmp"), "w") as f:
                    f.write(str(os.getppid()))
                os.replace(os.path.join(mark, f"started-{restart}-{rank}.tmp"),
                           os.path.join(mark, f"started-{restart}-{rank}"))
            if crashes(os.environ.get("EW_CRASH", ""), restart, rank):
                print(f"elastic_worker: rank {rank} crashing on purpose in round {restart}", file=sys.stderr, flush=True)
                os._exit(3)
        time.sleep(pause)
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
             "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT",
             "DISTLIB_INIT_METHOD"]
    record = {"env": {k: os.environ.get(k) for k in names}, "sum": total, "agent": os.getppid()}
    out = os.environ.get("EW_OUT")
    if out:
        with open(os.path.join(out, f"{restart}-{rank}.json"), "w") as f:
            json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
