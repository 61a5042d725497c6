"""The frames ranks exchange over their mesh connections (distlib's own format, not gloo's).

Every message is a 32-byte header followed by ``nbytes`` of payload::

    offset size field
    0      1    kind      1 DATA (collective), 2 P2P (send/recv), 3 ABORT, 4 HELLO, 5 HEARTBEAT
    1      1    op        collective code (OPS), so a rank that called all_reduce never
                          consumes bytes a peer sent for broadcast
    2      1    dtype     numpy dtype code (arrays.DTYPE_CODES), 0 for raw bytes
    3      1    redop     ReduceOp code, 0 when the operation does not reduce
    4      4    seq       u32 LE: the group's operation number (DATA); the user tag (P2P)
    8      4    step      u32 LE: the algorithm's step/chunk number within the operation
    12     4    reserved  zero
    16     8    count     u64 LE: elements the sender's whole operation covers (for errors)
    24     8    nbytes    u64 LE: payload bytes that follow

DATA frames are matched to receives by ``(seq, step)``, which every rank computes the same
way; P2P frames in order per (sender, tag), as MPI's non-overtaking rule. Before the payload
is read, the receiver checks op, dtype, reduce op and size against what it expects; a
mismatch means the ranks called different collectives or passed arrays of different shape or
dtype, and every rank is told (an ABORT frame carries the text) instead of reading
misaligned bytes. The check does not need the receive to be posted: a rank knows which
operation it is in, and any DATA frame of that operation (any step), or of one it has
finished, that says something else is a mismatch too. HELLO opens a connection: its 8-byte
payload is the sender's rank and the mesh id, checked by the acceptor so a stray connection
to a reused port is refused. HEARTBEAT is sent every few seconds by a rank that is blocked
waiting; its payload says what it waits for, so a rank that times out can tell a peer that
is alive (and waiting on somebody else) from one that has gone silent, and its op, dtype,
redop, seq and count fields describe the operation it waits in (op 0: not a collective), so
a rank in another collective of the same number learns of the mismatch even when no data
frame ever goes between the two. ABORT's ``seq`` is the rank that found the failure.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct("<BBBBIIIQQ")
HEADER_SIZE = HEADER.size  # 32

DATA = 1
P2P = 2
ABORT = 3
HELLO = 4
HEARTBEAT = 5

HELLO_PAYLOAD = struct.Struct("<IQ")  # sender rank, mesh id (64-bit hash of the group)

# Collective codes carried in the header's op field; the names are the API's.
OPS = {
    "barrier": 1,
    "broadcast": 2,
    "all_reduce": 3,
    "reduce": 4,
    "all_gather": 5,
    "gather": 6,
    "scatter": 7,
    "reduce_scatter": 8,
    "all_to_all": 9,
    "send": 10,
    "monitored_barrier": 11,
    "shm_sync": 12,
}
OP_NAMES = {code: name for name, code in OPS.items()}
ALL_TO_ALL = OPS["all_to_all"]


def pack(kind: int, op: int, dtype: int, redop: int, seq: int, step: int, count: int, nbytes: int) -> bytes:
    return HEADER.pack(kind, op, dtype, redop, seq & 0xFFFFFFFF, step & 0xFFFFFFFF, 0, count, nbytes)


def unpack(data) -> tuple:
    """(kind, op, dtype, redop, seq, step, count, nbytes)."""
    kind, op, dtype, redop, seq, step, _, count, nbytes = HEADER.unpack(data)
    return kind, op, dtype, redop, seq, step, count, nbytes


def describe(op: int, dtype: int, count: int, root: int = -1) -> str:
    """An operation in a user's words: ``broadcast of 10 x float32 from rank 0``."""
    from ....arrays import dtype_name

    name = OP_NAMES.get(op, f"op {op}")
    text = f"{name} of {count} x {dtype_name(dtype)}" if dtype else name
    if root >= 0:
        text += f" {'to' if name in ('reduce', 'gather') else 'from'} rank {root}"
    return text


def agree(theirs: tuple, mine: tuple) -> bool:
    """Whether two ranks are in the same collective: the one rule of the mesh's frames, its
    heartbeats and the shared-memory channel. ``theirs`` and ``mine`` are ``(op, dtype,
    redop, count)``, optionally followed by the root; every field must be equal, except the
    count of all_to_all (each rank's own share)."""
    if theirs == mine:
        return True
    return theirs[0] == ALL_TO_ALL and theirs[:3] == mine[:3] and theirs[4:] == mine[4:]


def disagreement(peer: str, theirs: tuple, mine: tuple, detail: str = "", verb: str = "sent") -> str:
    """The text of a mismatch (``theirs``/``mine`` as for agree): ``peer`` (``rank 1
    (host:port)``) ``verb`` (sent, is in, is waiting in) its collective, this rank is in
    another, and why; ``detail`` follows a difference of sizes."""
    why = why_mismatched(mine[:3] + mine[4:5], theirs[:3] + theirs[4:5])
    if why.endswith("sizes on different ranks"):
        why += detail
    return (f"mismatched collective: {peer} {verb} {describe(theirs[0], theirs[1], theirs[3], *theirs[4:5])}, "
            f"but this rank is in {describe(mine[0], mine[1], mine[3], *mine[4:5])}: {why}")


def why_mismatched(mine: tuple, theirs: tuple) -> str:
    """Why two ranks' ``(op, dtype, redop, root)`` disagree, or, if those agree, the sizes."""
    reasons = ("the ranks called different collectives (or the same ones in a different order)",
               "the arrays have different dtypes on different ranks",
               "the ranks passed different reduce ops",
               "the ranks passed different roots (src/dst)")
    for a, b, reason in zip(mine, theirs, reasons, strict=False):
        if a != b:
            return reason
    return "the arrays have different sizes on different ranks"
