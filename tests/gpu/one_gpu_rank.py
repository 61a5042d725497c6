"""Run a module as one of several ranks sharing one GPU in an NCCL communicator: sets this
rank's NCCL_HOSTID (from LOCAL_RANK, see gpu_cases.one_gpu_env), then runs the module as
``python -m`` would. For tests only, under a launcher:

    distlib run --nproc-per-node 2 -m tests.gpu.one_gpu_rank distlib_deploy.jobs.train_dp --epochs 3
"""

import os
import runpy
import sys

from .gpu_cases import one_gpu_env


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tests.gpu.one_gpu_rank MODULE [ARGS...]")
    os.environ.update(one_gpu_env(int(os.environ.get("LOCAL_RANK", "0") or 0)))
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
