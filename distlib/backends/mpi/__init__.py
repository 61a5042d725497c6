"""The ``mpi`` backend: every collective on MPI's own, through mpi4py (docs/mpi.md).

``backend.py`` is the backend, ``ops.py`` maps dtypes and reduce ops to MPI's, ``runtime.py``
initialises and finalises MPI, ``watchdog.py`` bounds every blocking call and asks the other
ranks what they are doing (``inquiry.py``). Nothing is imported here.
"""
