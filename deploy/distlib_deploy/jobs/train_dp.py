"""Data-parallel training of a small model, on numpy or, with NCCL, on cupy arrays: the job of
``make cluster-up`` (and of ``GPU=1 make cluster-up``).

Run it on every rank (``python -m distlib_deploy.jobs.train_dp`` under ``distlib-run``, or with
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set). What each rank does:

1. joins the default group: ``DISTLIB_INIT_METHOD`` when set (e.g. ``file:///shared/<run>/store``),
   else ``env://``; backend ``DISTLIB_BACKEND`` (default gloo; ``mpi`` under mpirun, which
   needs no init method); group timeout ``--timeout``. When the backend runs NCCL (``nccl`` or
   ``cpu:gloo,cuda:nccl``) the group is bound to ``cuda:LOCAL_RANK`` (``device_id``, as a torch
   job's ``torch.cuda.set_device(local_rank)``) and the model, its data and every array the job
   passes to a collective are cupy arrays there;
2. builds a 2-layer MLP (tanh hidden layer, logistic output) with its *own* random weights,
   then takes rank 0's with ``broadcast`` — after it, every rank holds the same model;
3. makes its shard of a synthetic binary-classification data set (a fixed teacher function
   labels Gaussian inputs; each rank draws its own samples);
4. trains ``--epochs`` x ``--steps-per-epoch`` SGD steps: forward and backward on a local batch,
   the gradients of all parameters packed in one buffer and ``all_reduce``'d (SUM, then
   divided by the world size: torch DDP's average), then applied with momentum;
5. measures ``all_reduce`` bandwidth at ``--bench-sizes`` (nccl-tests' algbw and busbw);
6. ``all_gather``s a sha256 of its final weights: unless every rank holds identical bytes the
   job fails on every rank (exit status 1);
7. rank 0 prints the report and writes ``--report-json`` (and ``--report-text``).

**Checkpoints** (``--checkpoint PATH --checkpoint-every N``), the pattern for an elastic job:
rank 0 writes the weights, the optimizer's momentum and the next step to PATH every N steps
(a new file renamed over the old one, so a reader never sees half of one); when the job starts
— the first time or after a restart, with the same or another world size — rank 0 reads PATH
if it exists and broadcasts it, and every rank goes on from that step. PATH must be on storage
every node shares (a node lost takes its local disk with it). Each epoch's shuffle is drawn
from (seed, rank, epoch), so a resumed epoch needs no saved random state.

On cupy the products are elementwise kernels and sums (``matmul``): cupy's ``@`` calls cuBLAS,
which the GPU image leaves out, and a 2177-parameter model does not need it.

Exit status: 0 on success; 1 when the weights differ or a collective failed (the error is
printed as ``train_dp: rank R FAILED: <error>``); 3 for ``--crash-rank`` (fault injection).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from distlib.distributed import get_identity

from ..sizes import format_size, parse_sizes
from . import _common as C

DEFAULT_BENCH_SIZES = "4KiB,1MiB,16MiB"


# -- the model --------------------------------------------------------------------------------------


def to_host(array) -> np.ndarray:
    """A numpy array of ``array``'s values (a copy from the GPU for a cupy array)."""
    return array if isinstance(array, np.ndarray) else array.get()


def matmul(xp, a, b):
    """``a @ b`` for a 2-D ``a`` and a 1-D or 2-D ``b``: numpy's (BLAS); on cupy an elementwise
    product and a sum over the shared axis, so that no cuBLAS is needed (module docstring)."""
    if xp is np:
        return a @ b
    if b.ndim == 1:
        return (a * b[None, :]).sum(axis=1)
    return (a[:, :, None] * b[None, :, :]).sum(axis=1)


class MLP:
    """x (B, D) → tanh(x W1 + b1) (B, H) → logit = h W2 + b2 (B,) → sigmoid; binary cross-entropy.
    The parameters live on ``xp`` (numpy, or cupy on the current device); the initial values are
    drawn on the host, so a rank's start does not depend on where it runs."""

    def __init__(self, features: int, hidden: int, rng: np.random.Generator, xp=np):
        self.xp = xp
        host = {
            "W1": (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32),
            "b1": np.zeros(hidden, np.float32),
            "W2": (rng.standard_normal(hidden) / np.sqrt(hidden)).astype(np.float32),
            "b2": np.zeros(1, np.float32),
        }
        self.params: Dict[str, "np.ndarray"] = {k: xp.asarray(v) for k, v in host.items()}
        self.names = list(self.params)
        self.velocity = {k: xp.zeros_like(v) for k, v in self.params.items()}

    def numel(self) -> int:
        return sum(int(p.size) for p in self.params.values())

    def flat(self):
        return self.xp.concatenate([self.params[k].reshape(-1) for k in self.names])

    def load_flat(self, flat: np.ndarray) -> None:
        offset = 0
        for k in self.names:
            p = self.params[k]
            p[...] = flat[offset:offset + p.size].reshape(p.shape)
            offset += p.size

    def flat_velocity(self):
        return self.xp.concatenate([self.velocity[k].reshape(-1) for k in self.names])

    def load_velocity(self, flat) -> None:
        offset = 0
        for k in self.names:
            v = self.velocity[k]
            v[...] = flat[offset:offset + v.size].reshape(v.shape)
            offset += v.size

    def digest(self) -> bytes:
        return hashlib.sha256(b"".join(to_host(self.params[k]).tobytes() for k in self.names)).digest()

    def loss_and_grads(self, x, y):
        """Mean loss and accuracy (0-d arrays on ``xp``: no host synchronisation per step) and
        the gradients packed in one float32 buffer."""
        xp, p = self.xp, self.params
        h = xp.tanh(matmul(xp, x, p["W1"]) + p["b1"])
        logit = matmul(xp, h, p["W2"]) + p["b2"][0]
        prob = 1.0 / (1.0 + xp.exp(-logit))
        eps = 1e-7
        loss = -xp.mean(y * xp.log(prob + eps) + (1 - y) * xp.log(1 - prob + eps))
        accuracy = xp.mean((prob > 0.5) == (y > 0.5))
        d_logit = (prob - y) / x.shape[0]                       # (B,)
        g_W2 = matmul(xp, h.T, d_logit)                         # (H,)
        g_b2 = d_logit.sum().reshape(1)
        d_h = d_logit[:, None] * p["W2"][None, :] * (1 - h * h)  # (B, H)
        g_W1 = matmul(xp, x.T, d_h)                             # (D, H)
        g_b1 = d_h.sum(axis=0)
        grads = {"W1": g_W1, "b1": g_b1, "W2": g_W2, "b2": g_b2}
        return loss, accuracy, xp.concatenate([grads[k].reshape(-1).astype(xp.float32) for k in self.names])

    def step(self, flat_grads: np.ndarray, lr: float, momentum: float) -> None:
        offset = 0
        for k in self.names:
            p = self.params[k]
            g = flat_grads[offset:offset + p.size].reshape(p.shape)
            offset += p.size
            v = self.velocity[k]
            v *= momentum
            v += g
            p -= lr * v


def synthetic_shard(rank: int, samples: int, features: int, seed: int):
    """This rank's samples of one data set: inputs N(0, 1), labels from a fixed teacher."""
    teacher = np.random.default_rng(seed)  # the same on every rank
    a = teacher.standard_normal(features)
    b = teacher.standard_normal(features)
    rng = np.random.default_rng([seed, 1 + rank])  # each rank its own samples
    x = rng.standard_normal((samples, features)).astype(np.float32)
    score = np.sin(x @ a / np.sqrt(features) * 2.0) + 0.5 * (x @ b) / np.sqrt(features)
    y = (score > 0).astype(np.float32)
    return x, y


# -- bandwidth --------------------------------------------------------------------------------------


def synchronizer(xp) -> Callable[[], None]:
    """What makes the host wait for the arrays' work: nothing on numpy; on cupy the current
    stream (a collective returns once enqueued and leaves that stream waiting for it)."""
    if xp is np:
        return lambda: None
    return lambda: xp.cuda.get_current_stream().synchronize()


def bench_all_reduce(dist, sizes: List[int], world: int, budget_s: float, xp=np) -> List[Dict[str, object]]:
    """nccl-tests' definitions: algbw = bytes / time; busbw = algbw x 2(n-1)/n (all_reduce).
    Time per op: the slowest rank's mean over the timed iterations; on cupy the host waits for
    the GPU before the clock starts and before it stops."""
    sync = synchronizer(xp)
    rows = []
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        array = xp.ones(count, xp.float32)
        dist.all_reduce(array)  # warm-up (and connection set-up of a fresh algorithm)
        # a correctness check on the warm-up: every element is the world size
        if not bool((array == world).all()):
            raise RuntimeError(f"all_reduce of {count} x float32 ones gave {to_host(array[:4])}..., not {world}")
        sync()
        probe = time.perf_counter()
        dist.all_reduce(array)
        sync()
        one = xp.asarray([time.perf_counter() - probe])
        dist.all_reduce(one, op=dist.ReduceOp.MAX)
        iters = int(max(3, min(50, (budget_s / max(len(sizes), 1)) / max(float(one[0]), 1e-4))))
        dist.barrier()
        sync()
        started = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(array)
        sync()
        elapsed = xp.asarray([(time.perf_counter() - started) / iters])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        t = float(elapsed[0])
        algbw = count * 4 / t / 1e9
        rows.append({"bytes": count * 4, "count": count, "dtype": "float32", "iterations": iters,
                     "time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (world - 1) / world})
    return rows


# -- the report -------------------------------------------------------------------------------------


def render_report(report: Dict[str, Any]) -> str:
    lines = []
    run = report["run"]
    lines.append(f"distlib train_dp report — run {run['run_id'] or '-'}: {run['world_size']} ranks on "
                 f"{run['nodes']} host(s), backend {run['backend']}")
    lines.append(f"init method: {run['init']}")
    r = report["rendezvous"]
    lines.append(f"rendezvous: {r['max_s']:.2f} s (init_process_group, max over ranks; min {r['min_s']:.2f} s)")
    lines.append("")
    gpu = any(h.get("device", "cpu") != "cpu" for h in report["ranks"])
    lines.append(C.table(["rank", "node", "host", "dns name", "address"] + (["device"] if gpu else []),
                         [[h["rank"], h["node_rank"], h["host"], h["dns_name"], h["address"]]
                          + ([h["device"]] if gpu else []) for h in report["ranks"]]))
    lines.append("")
    m = report["model"]
    lines.append(f"model: MLP {m['features']}-{m['hidden']}-1 ({m['parameters']} parameters, {m['arrays']} arrays), "
                 f"batch {m['batch_size']}/rank, {m['steps_per_epoch']} steps/epoch, lr {m['lr']}, "
                 f"one all_reduce of {m['parameters']} x float32 per step")
    lines.append(C.table(["epoch", "loss", "accuracy", "time"],
                         [[e["epoch"], f"{e['loss']:.4f}", f"{e['accuracy']:.3f}", f"{e['time_s']:.2f} s"]
                          for e in report["epochs"]]))
    if report["bandwidth"]:
        lines.append("")
        lines.append(f"all_reduce bandwidth (float32 SUM, {run['world_size']} ranks; algbw = size/time, "
                     f"busbw = algbw x 2(n-1)/n):")
        lines.append(C.table(["size", "count", "iters", "time/op", "algbw", "busbw"],
                             [[format_size(b["bytes"]), b["count"], b["iterations"],
                               f"{b['time_us'] / 1000:.2f} ms", f"{b['algbw_GBps']:.3f} GB/s",
                               f"{b['busbw_GBps']:.3f} GB/s"] for b in report["bandwidth"]]))
    lines.append("")
    e = report.get("elastic") or {}
    if e.get("restart_count") or e.get("resumed_from_step") is not None:
        resumed = (f"resumed from the checkpoint at step {e['resumed_from_step']} ({e['checkpoint']})"
                   if e.get("resumed_from_step") is not None else "started from scratch")
        lines.append(f"elastic: this is restart {e['restart_count']} of at most {e['max_restarts']}; {resumed}")
        lines.append("")
    w = report["weights"]
    if w["identical"]:
        lines.append(f"weights: identical on all {run['world_size']} ranks (sha256 {w['sha256'][0][:16]})")
    else:
        groups: Dict[str, List[int]] = {}
        for rank, digest in enumerate(w["sha256"]):
            groups.setdefault(digest, []).append(rank)
        lines.append("weights: DIFFER between ranks: " +
                     "; ".join(f"ranks {v} sha256 {k[:16]}" for k, v in groups.items()))
    lines.append(f"RESULT: {'PASS' if report['ok'] else 'FAIL'} in {report['elapsed_s']:.1f} s")
    return "\n".join(lines)


def save_checkpoint(path: str, model: "MLP", next_step: int, restart_count: int) -> None:
    """The weights, the momentum and the next step, written to a new file renamed over ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, params=to_host(model.flat()), velocity=to_host(model.flat_velocity()),
             next_step=np.int64(next_step), restart_count=np.int64(restart_count))
    os.replace(tmp, path)


def resume(dist, path: Optional[str], model: "MLP", xp) -> Optional[Dict[str, int]]:
    """Rank 0 reads the checkpoint at ``path`` (when there is one) and every rank takes it;
    None when there is none. A checkpoint of another model shape is an error that says so."""
    if not path:
        return None
    rank = dist.get_rank()
    meta = xp.zeros(2, xp.int64)  # found, next step
    loaded = None
    if rank == 0 and os.path.exists(path):
        with np.load(path) as data:
            loaded = {k: data[k] for k in ("params", "velocity", "next_step", "restart_count")}
        if loaded["params"].size != model.numel():
            raise RuntimeError(f"checkpoint {path} holds {loaded['params'].size} parameters, this model has "
                               f"{model.numel()}: a checkpoint of another --features/--hidden (remove it)")
        meta[0], meta[1] = 1, int(loaded["next_step"])
    dist.broadcast(meta, src=0)
    if not int(meta[0]):
        return None
    if rank == 0:
        assert loaded is not None, "meta[0] is 1: rank 0 loaded the checkpoint"
        params, velocity = xp.asarray(loaded["params"]), xp.asarray(loaded["velocity"])
        written_in = int(loaded["restart_count"])
    else:
        params, velocity = xp.empty(model.numel(), xp.float32), xp.empty(model.numel(), xp.float32)
        written_in = -1
    dist.broadcast(params, src=0)
    dist.broadcast(velocity, src=0)
    model.load_flat(params)
    model.load_velocity(velocity)
    return {"next_step": int(meta[1]), "written_in_restart": written_in}


def write_file(path: Optional[str], text: str) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# -- the job ----------------------------------------------------------------------------------------


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m distlib_deploy.jobs.train_dp", description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5, help="epochs (default 5)")
    p.add_argument("--steps-per-epoch", "--steps", dest="steps_per_epoch", type=int, default=40,
                   help="optimizer steps per epoch (default 40; --steps is an alias)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step (default 64)")
    p.add_argument("--features", type=int, default=32, help="input features (default 32)")
    p.add_argument("--hidden", type=int, default=64, help="hidden units (default 64)")
    p.add_argument("--lr", type=float, default=0.2, help="learning rate (default 0.2)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--seed", type=int, default=1234, help="data and initialisation seed (default 1234)")
    p.add_argument("--bench-sizes", default=DEFAULT_BENCH_SIZES,
                   help=f"all_reduce bandwidth points, comma-separated (default {DEFAULT_BENCH_SIZES}; "
                        "'' or 'none' to skip)")
    p.add_argument("--bench-seconds", type=float, default=6.0,
                   help="rough time budget of the bandwidth measurement (default 6)")
    p.add_argument("--report-json", metavar="PATH", help="rank 0 writes the report as JSON here")
    p.add_argument("--report-text", metavar="PATH", help="rank 0 writes the printed report here too")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="process-group timeout in seconds: init and every collective (default 300)")
    p.add_argument("--crash-rank", type=int, default=None,
                   help="fault injection: this rank exits with status 3 at the first step it runs (every time "
                        "it is started, e.g. after each restart of an elastic job)")
    p.add_argument("--checkpoint", metavar="PATH",
                   help="a checkpoint file on storage every node shares: written every --checkpoint-every steps "
                        "by rank 0, read at the start when it exists (the job resumes from it)")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="N",
                   help="steps between two checkpoints (default 10; with --checkpoint)")
    p.add_argument("--step-seconds", type=float, default=0.0, metavar="S",
                   help="pause after each step (default 0): stretches a demo so that a node can be lost mid-run")
    args = p.parse_args(argv)
    sizes = args.bench_sizes.strip().lower()
    args.sizes = [] if sizes in ("", "none", "0") else parse_sizes(args.bench_sizes)
    for name in ("epochs", "steps_per_epoch", "batch_size", "features", "hidden", "checkpoint_every"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def run(args: argparse.Namespace) -> int:
    import distlib as dist

    started = time.monotonic()
    url, init_s = C.join(None, args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    xp = C.array_module()
    if rank == 0:
        C.say(f"train_dp: {world} ranks joined through {C.describe_init(url)} in {init_s:.2f} s")

    # Who is where (rank 0 prints it): every rank's host, container name, advertised address.
    facts: List[Any] = [None] * world  # all_gather_object puts each rank's dict in its slot
    dist.all_gather_object(facts, C.host_facts(rank, init_s))
    C.place(facts)
    # Each rank looks up the DNS name of the next rank's address (in Docker: the container's
    # name; a container's own address resolves to its bare host name from /etc/hosts).
    names: List[Optional[str]] = [None] * world
    dist.all_gather_object(names, C.dns_name(facts[(rank + 1) % world]["address"]) if world > 1 else "-")
    for k in range(world):
        facts[k]["dns_name"] = names[(k - 1) % world]
    # ranks of one host share its name (a look-up from the same host gives the bare host name)
    by_host = {f["host"]: f["dns_name"] for f in facts if f["dns_name"] not in ("-", f["host"])}
    for f in facts:
        f["dns_name"] = by_host.get(f["host"], f["dns_name"])

    # Each rank starts from its own random weights; rank 0's win.
    model = MLP(args.features, args.hidden, np.random.default_rng([args.seed, 1000 + rank]), xp)
    flat = model.flat()
    dist.broadcast(flat, src=0)
    model.load_flat(flat)
    who = get_identity()  # as the group was made: under srun, nothing is in os.environ
    restart_count = who.restart_count
    if rank == 0:  # the first collective of this start (the elastic measurement reads this line)
        C.say(f"train_dp: first collective done: restart {restart_count}, world size {world}, unix {time.time():.3f}")
    resumed = resume(dist, args.checkpoint, model, xp)
    start_step = resumed["next_step"] if resumed else 0
    if rank == 0 and resumed:
        C.say(f"train_dp: resumed from the checkpoint {args.checkpoint} at step {start_step} (written in restart "
              f"{resumed['written_in_restart']}; now restart {restart_count}, world size {world})")

    samples = args.steps_per_epoch * args.batch_size
    x, y = (xp.asarray(a) for a in synthetic_shard(rank, samples, args.features, args.seed))

    epochs = []
    for epoch in range(1, args.epochs + 1):
        t0 = time.monotonic()
        order = np.random.default_rng([args.seed, 2000 + rank, epoch]).permutation(samples)
        sums = xp.zeros(3, xp.float64)  # loss sum, correct count, samples
        ran = 0
        for step in range(args.steps_per_epoch):
            global_step = (epoch - 1) * args.steps_per_epoch + step
            if global_step < start_step:
                continue
            if args.crash_rank == rank:
                C.say(f"train_dp: rank {rank}: --crash-rank {rank}: exiting with status 3 (fault injection)",
                      sys.stderr)
                os._exit(3)
            idx = xp.asarray(order[step * args.batch_size:(step + 1) * args.batch_size])
            loss, accuracy, grads = model.loss_and_grads(x[idx], y[idx])
            dist.all_reduce(grads)              # SUM over ranks ...
            grads /= world                      # ... then the average, as DDP
            model.step(grads, args.lr, args.momentum)
            sums[0] += loss * len(idx)
            sums[1] += accuracy * len(idx)
            sums[2] += len(idx)
            ran += 1
            if args.checkpoint and rank == 0 and (global_step + 1) % args.checkpoint_every == 0:
                save_checkpoint(args.checkpoint, model, global_step + 1, restart_count)
            if args.step_seconds:
                time.sleep(args.step_seconds)
        if not ran:
            continue  # an epoch the checkpoint had already finished
        dist.all_reduce(sums)
        totals = to_host(sums)  # (waits for the epoch's work on a GPU)
        entry = {"epoch": epoch, "loss": float(totals[0] / totals[2]), "accuracy": float(totals[1] / totals[2]),
                 "time_s": time.monotonic() - t0}
        epochs.append(entry)
        if rank == 0:
            C.say(f"train_dp: epoch {epoch}/{args.epochs}: loss {entry['loss']:.4f}, "
                  f"accuracy {entry['accuracy']:.3f} ({entry['time_s']:.2f} s)")

    bandwidth = bench_all_reduce(dist, args.sizes, world, args.bench_seconds, xp) if args.sizes else []

    # Identical weights everywhere, or the job fails on every rank.
    mine = xp.asarray(np.frombuffer(model.digest(), np.uint8))
    digests = [xp.empty(32, xp.uint8) for _ in range(world)]
    dist.all_gather(digests, mine)
    hexes = [bytes(to_host(d)).hex() for d in digests]
    identical = len(set(hexes)) == 1

    init_times = [f["init_s"] for f in facts]
    report = {
        "ok": identical,
        "run": {"run_id": who.run_id,
                "world_size": world, "nodes": len({f["host"] for f in facts}),
                "backend": str(dist.get_backend()), "init_method": url, "init": C.describe_init(url)},
        "rendezvous": {"max_s": max(init_times), "min_s": min(init_times), "per_rank_s": init_times},
        "ranks": facts,
        "model": {"kind": "mlp", "arrays": xp.__name__, "features": args.features, "hidden": args.hidden, "parameters": model.numel(),
                  "batch_size": args.batch_size, "steps_per_epoch": args.steps_per_epoch, "lr": args.lr,
                  "momentum": args.momentum, "seed": args.seed},
        "epochs": epochs,
        "bandwidth": bandwidth,
        "weights": {"identical": identical, "sha256": hexes},
        "elastic": {"restart_count": restart_count,
                    "max_restarts": who.max_restarts,
                    "checkpoint": args.checkpoint, "resumed_from_step": start_step if resumed else None},
        "elapsed_s": time.monotonic() - started,
    }
    if rank == 0:
        text = render_report(report)
        C.say("\n" + text)
        write_file(args.report_json, json.dumps(report, indent=2) + "\n")
        write_file(args.report_text, text + "\n")
    if not identical:
        C.say(f"train_dp: rank {rank} FAILED: the ranks' weights differ after training "
              f"(this rank: sha256 {hexes[rank][:16]})", sys.stderr)

    # Everyone is done with collectives before anyone leaves: with rank 0 hosting the store
    # (static rendezvous) its process must be the last to go.
    dist.barrier()
    dist.destroy_process_group()
    return 0 if identical else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except Exception as exc:  # noqa: BLE001 - one clear line, then the traceback
        rank = get_identity().rank
        C.say(f"train_dp: rank {'?' if rank is None else rank} on {socket.gethostname()} FAILED: "
              f"{C.error_name(exc)}: {exc}", sys.stderr)
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
