"""Tools around the library: benchmarks, cluster jobs, the demo and the Compose cluster driver.

They live apart from the library because a user who imports ``distlib`` needs none of them:
nothing outside this package imports it, except ``distlib/cli.py``, which hands the ``bench``,
``cluster`` and ``demo`` subcommands to it when they are run.
"""
