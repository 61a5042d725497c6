"""The Compose cluster driver: ``distlib cluster up|down|logs|ps|report|config`` (the Makefile's
``cluster-up``, ``cluster-down`` and ``cluster-logs``), on the docker SDK.

``config`` (the settings and Compose files of a run), ``state`` (the record of the last run),
``engine`` (the docker SDK and the Compose command), ``gpus`` (GPU=1: can the engine give the
workers GPUs, and how many), ``outcome`` (which container failed first, and what its log says),
``commands`` (the subcommands).
"""


def main(argv=None) -> int:
    from .commands import main as run

    return run(argv)
