"""Benchmarks: ``distlib bench store`` and ``distlib bench collectives``.

Each benchmark runs the same loads against distlib and, when torch is importable, against
torch, in separate processes, interleaved, and prints a table (``--json`` for machines).
Each benchmark is a command line (``store.py``, ``collectives.py``; ``collectives_cli.py``
picks the CPU or the GPU one), its runner (what runs in the children:
``store_children.py``, ``collectives_ranks.py``), its measurement (``store_measure.py``,
``collectives_measure.py``, with ``collectives_ops.py``: what is measured) and its report
(``store_report.py``, ``collectives_report.py``: tables, JSON, the plot). What they share:
``children.py`` (child processes with surfaced errors), ``timing.py`` (timing and
statistics), ``results.py`` (rows, targets, results) and ``tables.py`` (numbers, the table
printer, the environment a run records).
"""

#: What `distlib bench NAME` runs: NAME -> its module in this package.
BENCHMARKS = {"store": "store", "collectives": "collectives_cli", "elastic": "elastic"}


def main(argv=None) -> int:
    """``distlib bench NAME [options]`` (and ``distlib-bench NAME``): hand the options to NAME's
    command line, imported only now."""
    import importlib
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in BENCHMARKS:
        if argv and argv[0] in ("-h", "--help"):
            print(f"usage: distlib bench {{{','.join(BENCHMARKS)}}} [options]; "
                  f"distlib bench store --help for the options")
            return 0
        print(f"distlib bench: choose what to measure: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"{__name__}.{BENCHMARKS[argv[0]]}").main(argv[1:])
