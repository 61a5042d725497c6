"""The ``nccl`` backend: collectives on cupy arrays through NCCL (docs/gpu.md).

``backend.py`` turns each collective into NCCL calls planned by ``plan.py``, with dtypes and
ops mapped by ``dtypes.py`` and the GPU chosen by ``devices.py``; ``comm.py`` owns the
communicator, ``watchdog.py`` watches the outstanding work, whose Works are ``work.py``.
Nothing is imported here: ``import distlib.backends.nccl.backend`` loads the backend.
"""
