"""Every size at which the gloo backend changes its way, in one place: the router's policy.

One observation sets most of them: up to about 256 KiB a collective is latency-bound (one
round of messages beats moving less data), above it bandwidth-bound. So 256 KiB is the small
channel's slot, the smallest all_reduce the shared segment takes when there is no channel,
and the most data per rank times peers that goes in one direct exchange
(bench/performance-log.md, 2026-11-24). ``Router`` (router.py) is the only reader: the
algorithms it calls take no decision of size.
"""

from __future__ import annotations

#: Up to this many bytes a message is latency-bound (see the module docstring).
SMALL_BYTES = 256 << 10

# -- routes: the small channel, the shared segment, the mesh ---------------------------------------

#: Collectives whose part per rank fits a slot of the small channel go through it (all ranks
#: local): SMALL_SLOT_BYTES, or less in large groups, so that an all_reduce (where every rank
#: reads every slot) reads at most SMALL_READ_BYTES per rank. Above the slot the two-phase
#: path of the shared segment's rounds takes over: the one-exchange channel is faster up to
#: about 256 KiB, level there, behind above (bench/performance-log.md, 2026-11-24).
SMALL_SLOT_BYTES = SMALL_BYTES
SMALL_READ_BYTES = 1 << 20
#: all_reduce of at least this many bytes per rank goes through the shared segment (all ranks
#: local) in rounds (algorithms/shm_allreduce.py) when the group has no small channel; with
#: one, everything above its slot does.
SEGMENT_MIN_BYTES = SMALL_BYTES
#: Bytes per rank per round in the shared segment.
SEGMENT_SLOT_BYTES = 8 << 20

# -- algorithms over the mesh ------------------------------------------------------------------------

#: An all_reduce, reduce or reduce_scatter whose data per rank times the peers is at most this
#: goes directly (every rank to every other, to the root, or to its owner); above it, round a
#: ring (all_reduce: also up to DIRECT_MAX_RANKS ranks only).
DIRECT_BYTES = SMALL_BYTES
DIRECT_MAX_RANKS = 8
#: Up to this many bytes per rank an all_reduce is latency-bound on the mesh: a one-round or
#: log-round algorithm, not the ring.
LATENCY_BYTES = 64 << 10
#: Above this many bytes (and more than two ranks) broadcast goes scatter + ring all-gather.
BROADCAST_SPLIT_BYTES = SMALL_BYTES
#: Above this many bytes per rank all_gather goes round the ring.
ALL_GATHER_RING_BYTES = 64 << 10


def small_slot_bytes(size: int) -> int:
    """The small channel's slot in a group of ``size`` ranks (a multiple of 64 bytes)."""
    return max(4096, min(SMALL_SLOT_BYTES, SMALL_READ_BYTES // max(1, size)) // 64 * 64)


def segment_min_bytes(small_slot: int) -> int:
    """The smallest all_reduce (bytes per rank) the shared segment takes; ``small_slot``: the
    small channel's slot (-1: the group has none)."""
    return small_slot + 1 if small_slot >= 0 else SEGMENT_MIN_BYTES


def choose_all_reduce(nbytes: int, n: int, crowded: bool = False) -> str:
    """The algorithm (algorithms/reduce.py's ALL_REDUCE) for an all_reduce of ``nbytes`` per
    rank over ``n`` ranks on the mesh.

    ``crowded``: the ranks on this machine outnumber its CPUs. Then the CPUs, not the
    rounds, are the bottleneck, and the algorithm that moves the fewest frames wins: each
    frame costs its sender a system call that also runs the receiver's side of loopback TCP
    and wakes it. The tree moves 2(n-1) frames, recursive doubling about n log2 n, the
    direct exchange n(n-1) (measurements: bench/performance-log.md, 2026-11-24). With a CPU
    per rank the rounds count, and the one-round direct exchange stays.
    """
    if n == 1:
        return "none"
    if nbytes <= LATENCY_BYTES and crowded and n > 2:
        return "tree"
    if direct(nbytes, n) and n <= DIRECT_MAX_RANKS:
        return "direct"
    if nbytes <= LATENCY_BYTES:
        return "recursive_doubling"
    return "ring"


def direct(nbytes: int, n: int) -> bool:
    """Whether ``nbytes`` per rank over ``n`` ranks go in one direct exchange (reduce,
    reduce_scatter; all_reduce with few ranks)."""
    return nbytes * (n - 1) <= DIRECT_BYTES


def broadcast_splits(nbytes: int, n: int) -> bool:
    """Whether a broadcast goes scatter + all-gather (the root sends the array once, not n-1 times)."""
    return n > 2 and nbytes > BROADCAST_SPLIT_BYTES


def all_gather_rings(nbytes: int) -> bool:
    """Whether an all_gather of ``nbytes`` per rank goes round the ring."""
    return nbytes > ALL_GATHER_RING_BYTES
