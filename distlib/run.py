"""``distlib-run`` (also ``distlib run``): a torchrun-like launcher for distlib jobs.

    distlib-run [--nnodes N|MIN:MAX] [--nproc-per-node N|auto|cpu|gpu] [--node-rank N|auto]
                [--master-addr HOST] [--master-port PORT]
                [--rdzv-backend static|c10d] [--rdzv-endpoint HOST[:PORT]|file:///PATH] [--run-id ID]
                [--max-restarts N] [--monitor-interval S] [--rdzv-conf K=V,...] [--store-outage-timeout S]
                [--log-dir DIR] [-r SPEC] [-t SPEC] [--local-ranks-filter R,...]
                [--log-line-prefix-template T] [--role NAME]
                [--standalone] [--grace-period S] [--rdzv-timeout S] [--dry-run]
                (-m MODULE | SCRIPT) [ARGS...]

This module is only the command line: settings are resolved by distlib/launcher/resolve.py
(flags, then the cluster's environment conventions, then defaults), the node is launched by
distlib/launcher/launch.py and its workers supervised by distlib/launcher/agent.py; an elastic
launch (``--nnodes MIN:MAX``, ``--max-restarts N``, a file:// endpoint) by
distlib/launcher/elastic_agent.py. The docs are docs/launcher.md.

Exit status: 0 when every worker succeeded; the failed worker's exit code (128 + N when it
was killed by signal N); 128 + N when the launcher was stopped by signal N; 2 for a usage or
configuration error; 1 when the launch itself failed (e.g. no master service answered), and
when an elastic job failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

from . import settings
from .launcher.elastic_config import DEFAULT_MONITOR_INTERVAL, elastic_plan, is_elastic
from .launcher.launch import Options, launch
from .launcher.output import DEFAULT_PREFIX_TEMPLATE, OutputError, OutputSpec, parse_ranks_filter, run_log_dir
from .launcher.report import dry_run_text
from .launcher.resolve import Flags, ResolveError, resolve
from .launcher.workerenv import Program


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
    return value


def _pet(name: str, default: Optional[str] = None) -> Optional[str]:
    """torchrun reads every flag's default from PET_<FLAG> (Kubeflow sets them): the same here."""
    value = os.environ.get(f"PET_{name}", "").strip()
    return value or default


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distlib-run", allow_abbrev=False,
        description="Start this node's workers of a distlib job (torchrun's flags). Values not given as "
                    "flags come from the cluster's environment (PET_*, Kubeflow PyTorchJob, Indexed Job, "
                    "LeaderWorkerSet, Volcano), else torchrun's defaults; --dry-run shows what was resolved "
                    "and from where. See docs/launcher.md.")
    add = parser.add_argument
    add("--nnodes", help="number of nodes, N, or MIN:MAX for an elastic job of MIN to MAX nodes; default 1")
    add("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
        help="workers on this node: a number, cpu, gpu or auto (GPUs if any, else CPUs); default 1")
    add("--node-rank", "--node_rank", dest="node_rank",
        help="this node's rank, 0..nnodes-1, or 'auto': take the next free one from the master service "
             "(needs --rdzv-backend c10d); default 0")
    add("--master-addr", "--master_addr", dest="master_addr",
        help="static backend: the host of global rank 0, which hosts the store; default 127.0.0.1")
    add("--master-port", "--master_port", dest="master_port",
        help="static backend: the store's port on that host; default 29500")
    add("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
        help="static (default: global rank 0 hosts the store) or c10d (a distlib store-server runs at "
             "--rdzv-endpoint; every rank is its client)")
    add("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
        help="HOST[:PORT] of the master service (c10d; port default 29500), or file:///PATH: a FileStore on a "
             "shared file system holds the rendezvous (no master service); with static, the master's address")
    add("--run-id", "--rdzv-id", "--run_id", "--rdzv_id", dest="run_id",
        help="the run's id, the same on every node; namespaces its keys on a shared master service "
             "(default: PET_RDZV_ID, DISTLIB_RUN_ID, TORCHELASTIC_RUN_ID, else 'none')")
    add("--max-restarts", "--max_restarts", dest="max_restarts", type=_count,
        default=_pet("MAX_RESTARTS", "0"),
        help="restarts the whole job may make (a worker failed, a node was lost or joined), counted once for "
             "the job, not per node; default 0 (PET_MAX_RESTARTS)")
    add("--monitor-interval", "--monitor_interval", dest="monitor_interval", type=_positive,
        default=_pet("MONITOR_INTERVAL", str(DEFAULT_MONITOR_INTERVAL)), metavar="S",
        help=f"seconds between two looks at the workers and the rendezvous (elastic; default "
             f"{DEFAULT_MONITOR_INTERVAL:g})")
    add("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", default=_pet("RDZV_CONF"), metavar="K=V,...",
        help="torch's rendezvous settings: join_timeout (600), last_call_timeout (30), close_timeout (30), "
             "keep_alive_interval (2), keep_alive_max_attempt (5: a node silent 2 x 5 = 10 s is lost), "
             "heartbeat_timeout (5), timeout (60)")
    add("--store-outage-timeout", dest="store_outage_timeout", type=_positive, metavar="S",
        default=settings.store_outage_timeout(),
        help="elastic: seconds the agents ride out a rendezvous store that stopped answering (a master service "
             "restarting with its journal): the workers keep running and the job goes on in the same round; "
             "past it every node fails naming the store (default 60; env DISTLIB_STORE_OUTAGE_TIMEOUT)")
    add("--role", default=_pet("ROLE", "default"), help="the workers' ROLE_NAME (default 'default')")
    add("--log-dir", "--log_dir", dest="log_dir", default=_pet("LOG_DIR"),
        help="base directory of the workers' log files (--redirects, --tee): <dir>/<run id>_<random>/"
             "attempt_<N>/<local rank>/{stdout,stderr}.log")
    add("-r", "--redirects", default=_pet("REDIRECTS", "0"),
        help="send streams to the log files instead of the console: 0 none, 1 stdout, 2 stderr, 3 both, or "
             "LOCAL_RANK:N,... (e.g. 0:3,1:2)")
    add("-t", "--tee", default=_pet("TEE", "0"), help="send streams to the log files and the console (as -r)")
    add("--local-ranks-filter", "--local_ranks_filter", dest="local_ranks_filter",
        default=_pet("LOCAL_RANKS_FILTER"), help="show only these local ranks' output on the console, e.g. 0,1")
    add("--log-line-prefix-template", "--log_line_prefix_template", dest="log_line_prefix_template",
        default=_pet("LOG_LINE_PREFIX_TEMPLATE", os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")),
        help="the prefix of every worker line on the console, with ${rank}, ${local_rank}, ${role_name} "
             f"(default {DEFAULT_PREFIX_TEMPLATE!r}; '' for none)")
    add("--standalone", action="store_true",
        help="single node: a private store on a free port of this machine (c10d, endpoint 127.0.0.1:0)")
    add("--grace-period", type=_positive, default=5.0, metavar="S",
        help="seconds between SIGTERM and SIGKILL when workers are stopped (default 5)")
    add("--rdzv-timeout", type=_positive, default=300.0, metavar="S",
        help="seconds to wait for the master service (c10d) (default 300)")
    add("--dry-run", action="store_true",
        help="print every resolved value, where it came from, and each worker's environment; start nothing")
    add("--log-level", default=settings.log_level(),
        help="the launcher's logging level (default INFO; env DISTLIB_LOG_LEVEL)")
    add("-m", "--module", action="store_true",
        help="run the program as a module: python -m MODULE (as python -m)")
    add("program", nargs="?", metavar="SCRIPT|MODULE", help="the Python script (or, with -m, module) to run")
    add("args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.program is None and not args.dry_run:
        parser.error("what to run is missing: a script, or -m and a module")
    _setup_logging(args.log_level)
    flags = Flags(
        nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=args.rdzv_endpoint, run_id=args.run_id, standalone=args.standalone,
    )
    try:
        resolved = resolve(flags, os.environ)
        plan = None
        if is_elastic(resolved, args.max_restarts):
            plan = elastic_plan(resolved, args.max_restarts, args.monitor_interval, args.rdzv_conf,
                                args.store_outage_timeout)
        template = args.log_line_prefix_template
        output = OutputSpec(DEFAULT_PREFIX_TEMPLATE if template is None else template,
                            parse_ranks_filter(args.local_ranks_filter), args.redirects, args.tee)
        output.check()
    except (ResolveError, OutputError) as exc:
        print(f"distlib-run: error: {exc}", file=sys.stderr)
        return 2
    program = Program(args.program or "<no program given>", tuple(args.args), args.module)
    if args.dry_run:
        sys.stdout.write(dry_run_text(resolved, program, plan))
        sys.stdout.flush()
        return 0
    if output.needs_files() or args.log_dir:
        from dataclasses import replace

        output = replace(output, log_dir=run_log_dir(args.log_dir, str(resolved.run_id.value)))
        logging.getLogger("distlib.launcher").info("workers' log files: %s", output.log_dir)
    try:
        return launch(resolved, program, Options(grace_period=args.grace_period, rdzv_timeout=args.rdzv_timeout,
                                                 output=output, role=args.role, elastic=plan))
    except KeyboardInterrupt:
        print("distlib-run: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
