"""gloo's collective algorithms: over the mesh (reduce.py, gather.py, p2p.py) and through
shared memory (shm_small.py, shm_allreduce.py), each given one operation's context."""
