"""The deployment around the library: the Compose cluster driver (``distlib cluster``), the jobs
the images run (``distlib_deploy.jobs``) and the demo (``distlib demo``).

A package of its own (distribution distlib-c10d-deploy, in deploy/ of the repository) because a
user who installs distlib-c10d for ``init_process_group`` needs none of it: the library never
imports this package; the ``distlib`` command finds its subcommands through the entry-point
group ``distlib.commands``. The images install it beside the library (docker/Dockerfile).
"""
