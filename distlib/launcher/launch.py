"""One node's launch, in order: the master service (c10d, elastic), the node rank (``auto``), the
no-token warning, the workers; an elastic launch's rounds and workers are elastic_agent.py's.

``launch(resolved, program, options)`` returns the launcher's exit status (agent.py says what
it means). With ``DISTLIB_INIT_METHOD`` set (e.g. the Helm chart's file mode,
``file:///shared/<run>/store``) no TCP store is started or contacted: the job rendezvous
through that URL, and the launcher only passes it on.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

from ..exposure import warn_open_job
from ..settings import token_configured
from ..store.tcp.connect import format_endpoint
from .agent import Worker, run_workers, say
from .elastic_config import ElasticPlan
from .output import OutputSpec
from .master import HostedStore, LauncherError, node_rank_key, serve, take_node_rank
from .resolve import Resolved
from .workerenv import Program, full_env

log = logging.getLogger("distlib.launcher")


@dataclass
class Options:
    #: Seconds between SIGTERM and SIGKILL when workers are stopped.
    grace_period: float = 5.0
    #: Seconds to wait for the master service (c10d), and for other nodes' clients to leave a
    #: store this agent hosts.
    rdzv_timeout: float = 300.0
    #: Where the workers' output goes (output.py).
    output: OutputSpec = field(default_factory=OutputSpec)
    #: ROLE_NAME of the workers (torchrun's --role).
    role: str = "default"
    #: Set for an elastic launch (elastic_config.is_elastic): rounds, restarts, heartbeats.
    elastic: Optional[ElasticPlan] = None


def _summary(resolved: Resolved) -> str:
    node = resolved.node_rank.value
    nproc = resolved.nproc_per_node.value
    first = node * nproc
    where = format_endpoint(str(resolved.master_addr.value), int(resolved.master_port.value))
    if resolved.init_method is not None:
        how = f"init method {resolved.init_method.value} (DISTLIB_INIT_METHOD)"
    elif resolved.c10d:
        how = f"c10d rendezvous: every rank is a client of the master service at {where}"
    else:
        how = f"static rendezvous: global rank 0 hosts the store at {where}"
    return (f"node {node} of {resolved.nnodes.value}: starting {nproc} worker(s), global ranks "
            f"{first}..{first + nproc - 1} of {resolved.world_size}; {how}; run id {resolved.run_id.value!r}")


def _hosts_tcp_store(resolved: Resolved, elastic: bool) -> bool:
    """Whether this launch has a TCP store at the resolved endpoint that this node may have to
    host: c10d, and every elastic launch without a file endpoint (its rounds live there)."""
    return resolved.init_method is None and resolved.rdzv_file is None and (resolved.c10d or elastic)


def _warn_if_open(resolved: Resolved, environ: Mapping[str, str], elastic: bool) -> None:
    """The no-token warning (distlib/exposure.py), for every launch whose store or ranks other
    hosts can reach; an elastic job's says what its store holds."""
    store = f"file {resolved.rdzv_file.value}" if resolved.rdzv_file is not None else None
    warn_open_job(str(resolved.master_addr.value), int(resolved.master_port.value), token_configured(environ),
                  resolved.nnodes.value > 1, store=store,
                  consequence=ELASTIC_EXPOSURE if elastic and resolved.rdzv_file is None else "")


#: What a no-token elastic job exposes (docs/launcher.md#elastic-jobs says it too).
ELASTIC_EXPOSURE = ("; the store also holds this elastic job's rounds: anyone who reaches it can end the job or use up "
                    "its restarts")


def launch(resolved: Resolved, program: Program, options: Options,
           environ: Optional[Mapping[str, str]] = None) -> int:
    environ = os.environ if environ is None else environ
    elastic = options.elastic is not None
    for warning in resolved.warnings:
        log.warning("%s", warning)
    for note in resolved.notes + list(options.elastic.notes if options.elastic else ()):
        log.info("%s", note)
    hosted: Optional[HostedStore] = None
    private = resolved.private_store
    try:
        try:
            if _hosts_tcp_store(resolved, elastic):
                hosted, resolved = serve(resolved, options.rdzv_timeout)
            if resolved.node_rank_auto and not elastic:
                host, port = str(resolved.master_addr.value), int(resolved.master_port.value)
                rank = take_node_rank(host, port, str(resolved.run_id.value), resolved.nnodes.value,
                                      options.rdzv_timeout)
                resolved = resolved.with_node_rank(
                    rank, f"--node-rank auto: the counter {node_rank_key(str(resolved.run_id.value))} "
                          f"at {format_endpoint(host, port)}")
                log.info("node rank %d taken from the master service", rank)
        except LauncherError as exc:
            say(str(exc))
            return 1
        if options.elastic is not None:
            _warn_if_open(resolved, environ, elastic=True)  # once per process, what to do (distlib/exposure.py)
            return _run_elastic(resolved, program, options, options.elastic, environ, hosted, private)
        log.info("%s", _summary(resolved))
        _warn_if_open(resolved, environ, elastic=False)
        node = resolved.node_rank.value
        nproc = resolved.nproc_per_node.value
        argv = program.argv()
        workers = [Worker(local, node * nproc + local, argv, full_env(environ, resolved, local, role=options.role),
                          options.output, 0, options.role)
                   for local in range(nproc)]
        status = run_workers(workers, node, resolved.nnodes.value, options.grace_period)
        if hosted is not None and status == 0:
            hosted.linger(options.rdzv_timeout)
        return status
    finally:
        if hosted is not None:
            hosted.stop()


def _run_elastic(resolved: Resolved, program: Program, options: Options, plan: ElasticPlan,
                 environ: Mapping[str, str], hosted: Optional[HostedStore], private: bool) -> int:
    """The elastic agent of this node; ``hosted``: the store this launch runs in-process, if
    any (``private``: on a free port, for this node alone)."""
    from .elastic_agent import ElasticAgent

    if hosted is not None and not private:
        log.warning("this agent hosts the rendezvous store at %s in-process: if this node is lost, every node "
                    "fails with it. An elastic job should have a master service of its own (distlib "
                    "store-server) or a file:// endpoint",
                    format_endpoint(str(resolved.master_addr.value), int(resolved.master_port.value)))
    status = ElasticAgent(resolved, plan, program, options.output, options.grace_period, environ, options.role,
                          hosted).run()
    if hosted is not None and status == 0:  # the others' last calls after a success
        hosted.linger(plan.conf.close_timeout)
    return status
