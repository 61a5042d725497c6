"""``python -m distlib.testing.function_rank module:qualname``: run a function job's function
on this rank and keep its return value for the harness (``<run dir>/value-<rank>.pkl``)."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from . import settings


def main(argv: list) -> int:
    if len(argv) != 1 or ":" not in argv[0]:
        print("usage: python -m distlib.testing.function_rank module:qualname", file=sys.stderr)
        return 2
    module_name, qualname = argv[0].split(":", 1)
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    run_dir = settings.run_dir()
    if not run_dir:
        print("distlib.testing.function_rank runs only under the harness (no run directory given)", file=sys.stderr)
        return 2
    args = pickle.loads(Path(run_dir, "function-args.pkl").read_bytes())
    value = target(*args)
    rank = os.environ.get("RANK", "0")
    Path(run_dir, f"value-{rank}.pkl").write_bytes(pickle.dumps(value))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
