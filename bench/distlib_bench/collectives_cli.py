"""``distlib bench collectives``: the options, then the CPU benchmark (collectives.py) or, with
``--device cuda``, the GPU one (collectives_cuda.py, which builds on the CPU one).

Its own module so that the two benchmarks depend one way only: the GPU one extends the CPU
one, and only this entry point knows both.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from distlib import command
from . import collectives, collectives_cuda


def main(argv: Optional[List[str]] = None) -> int:
    parser = collectives.build_parser()
    cuda = _device(argv) == "cuda"
    if cuda:
        collectives_cuda.set_defaults(parser)
    args = parser.parse_args(argv)
    if "log_level" in args:
        command.setup_logging(args.log_level)
    run = collectives_cuda.run if cuda else collectives.run
    return command.run("distlib bench collectives", lambda: run(args))


def _device(argv: Optional[List[str]]) -> str:
    """The --device the command line asks for (its other options keep their own defaults)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cpu")
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    return known.device


if __name__ == "__main__":
    sys.exit(main())
