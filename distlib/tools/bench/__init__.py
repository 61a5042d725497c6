"""Benchmarks: ``distlib bench store`` and ``distlib bench collectives``.

Each benchmark runs the same loads against distlib and, when torch is importable, against
torch, in separate processes, interleaved, and prints a table (``--json`` for machines).
``common`` holds what they share: child processes with surfaced errors, timing and
statistics helpers, the table printer and the JSON report.
"""
