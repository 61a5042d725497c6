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
