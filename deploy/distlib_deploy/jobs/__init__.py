"""Jobs that run on a distlib cluster (the Compose cluster of ``make cluster-up``, the Helm
chart, or any ``distlib-run``):

* ``distlib_deploy.jobs.train_dp``          — data-parallel training of a small numpy model, with a
  report (ranks, rendezvous time, loss by epoch, all_reduce bandwidth) and a check that every
  rank ends with identical weights; the cluster's main job.
* ``distlib_deploy.jobs.check_collectives`` — rendezvous, one all_reduce and one all_gather whose
  results are checked, one line per rank; optionally a loop of large all_reduces (the
  container tests kill, cut off or stop things during it).
* ``distlib_deploy.jobs.compose_node``      — the entry point of one Compose worker container: finds
  its node rank for the rendezvous mode and starts ``distlib-run``.
* ``distlib_deploy.jobs.mpi_sshd``, ``mpi_launch``, ``mpi_rank`` — the Compose cluster's MODE=mpi:
  a worker's SSH daemon, the launcher's ``mpirun`` over SSH, and the parent of each rank that
  records how the rank ended.

Shared helpers are in ``_common.py``.
"""
