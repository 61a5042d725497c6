"""The ``gloo`` backend: distlib's own CPU collectives (docs/architecture.md, "The gloo backend").

``backend.py`` is the backend; ``group_setup.py`` joins a group; ``routes.py`` says where each
collective goes; ``algorithms/`` are the collectives over the mesh and shared memory;
``transport/`` is the mesh (TCP) and the same-host shared memory, which only gloo uses.
Nothing is imported here: ``import distlib.backends.gloo.backend`` loads the backend.
"""
