"""What NCCL is told about an array and a reduce op, decided before anything is enqueued.

NCCL knows ten element types and five reductions (the enum values below are NCCL's ABI,
``nccl.h``; cupy passes them through unchanged). Everything else is mapped or refused here,
in pure code, so that a refusal happens before the stream sees the operation:

* bool travels as uint8; SUM and MAX become MAX (logical or), PRODUCT and MIN become MIN
  (logical and), as torch's ProcessGroupNCCL does, and as distlib's gloo computes bool.
* complex travels as pairs of floats, which is right for data movement, SUM, AVG and
  PREMUL_SUM (a real factor); PRODUCT of pairs is not a complex product, so it is refused.
* AVG is NCCL's own (``ncclAvg``, NCCL 2.10 and later), else a SUM then a division.
* PREMUL_SUM scales each rank's input by the factor first, then sums.
* BAND, BOR, BXOR: NCCL has no bitwise reductions, a ValueError in torch's words.
* bfloat16 where the array library has one (numpy through ml_dtypes): NCCL's bfloat16.
* any other dtype (int16, uint16, float128, ...): a TypeError in torch's words.

The unique id that rank 0 publishes is 128 bytes in NCCL; cupy 14 hands it out as ``bytes``
and cupy 13 as a tuple of 128 signed chars. Both are stored as the raw bytes and handed to
the local cupy in the form it takes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np

from ...reduce_op import RedOpType, ReduceOp

# ncclDataType_t
INT8, UINT8, INT32, UINT32, INT64, UINT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = range(10)
# ncclRedOp_t
SUM, PROD, MAX, MIN, AVG = range(5)

#: NCCL version code (major*10000 + minor*100 + patch since 2.9) from which ncclAvg exists.
NATIVE_AVG_VERSION = 21000

UNIQUE_ID_BYTES = 128

NCCL_TYPE_NAMES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
                   "bfloat16")

#: dtype name -> (NCCL type, the dtype NCCL sees, NCCL elements per array element)
_WIRE = {
    "int8": (INT8, "int8", 1), "uint8": (UINT8, "uint8", 1), "int32": (INT32, "int32", 1),
    "uint32": (UINT32, "uint32", 1), "int64": (INT64, "int64", 1), "uint64": (UINT64, "uint64", 1),
    "float16": (FLOAT16, "float16", 1), "float32": (FLOAT32, "float32", 1), "float64": (FLOAT64, "float64", 1),
    "bfloat16": (BFLOAT16, "bfloat16", 1), "bool": (UINT8, "uint8", 1),
    "complex64": (FLOAT32, "float32", 2), "complex128": (FLOAT64, "float64", 2),
}

_NATIVE_OPS = {RedOpType.SUM: SUM, RedOpType.PRODUCT: PROD, RedOpType.MIN: MIN, RedOpType.MAX: MAX,
               RedOpType.PREMUL_SUM: SUM}
_BOOL_OPS = {RedOpType.SUM: MAX, RedOpType.MAX: MAX, RedOpType.PRODUCT: MIN, RedOpType.MIN: MIN}


@dataclass(frozen=True)
class Wire:
    """How an array travels: NCCL's type, the dtype to view the array as, elements per item."""

    nccl_type: int
    view: str
    per_item: int

    def count(self, items: int) -> int:
        return items * self.per_item


@dataclass(frozen=True)
class Reduction:
    """A reduction as NCCL runs it: its op, the factor to premultiply each input by (None for
    none), and whether the result must be divided by the group size afterwards."""

    wire: Wire
    nccl_op: int
    premul: Optional[float]
    divide: bool


def is_bfloat16(dtype) -> bool:
    """True for a bfloat16 dtype of any array library (numpy's through ml_dtypes, cupy's)."""
    return getattr(dtype, "name", str(dtype)) == "bfloat16"


def wire(dtype) -> Wire:
    """How ``dtype`` travels through NCCL, or TypeError (torch's text) when it cannot."""
    name = getattr(dtype, "name", None) or np.dtype(dtype).name
    found = _WIRE.get(name)
    if found is None:
        raise TypeError(
            f"Input tensor data type is not supported for NCCL process group: {name} "
            f"(NCCL has {', '.join(NCCL_TYPE_NAMES)}; distlib adds bool as uint8 and complex as pairs of "
            f"floats): cast the array first")
    return Wire(*found)


def reduction(dtype, op: ReduceOp, nccl_version: int) -> Reduction:
    """How ``op`` on ``dtype`` runs through NCCL, or the error that refuses it.

    Called after distlib's own rules (reduce_op.check_op_for_dtype: AVG and PREMUL_SUM need
    floating point, no MIN/MAX on complex), so only NCCL's own limits are checked here.
    """
    kind = op.op
    if kind in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR):
        raise ValueError(f"Cannot use ReduceOp.{kind.name} with NCCL: NCCL has no bitwise reductions, so the "
                         f"nccl backend refuses it; run it on a gloo group (numpy arrays, or cupy arrays "
                         f"staged through host memory)")
    how = wire(dtype)
    name = getattr(dtype, "name", None) or np.dtype(dtype).name
    if name == "bool":
        if kind not in _BOOL_OPS:
            raise TypeError(f"Cannot use ReduceOp.{kind.name} with boolean inputs")
        return Reduction(how, _BOOL_OPS[kind], None, False)
    if how.per_item == 2 and kind not in (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM):
        raise TypeError(f"Cannot use ReduceOp.{kind.name} on {name} with NCCL: complex numbers are reduced as "
                        f"pairs of floats, which is right only for SUM, AVG and PREMUL_SUM")
    if kind == RedOpType.AVG:
        if nccl_version >= NATIVE_AVG_VERSION:
            return Reduction(how, AVG, None, False)
        return Reduction(how, SUM, None, True)
    premul = None
    if kind == RedOpType.PREMUL_SUM:
        assert op.factor is not None, "as_reduce_op refuses PREMUL_SUM without its factor"
        premul = float(op.factor)
    return Reduction(how, _NATIVE_OPS[kind], premul, False)


# -- the unique id -------------------------------------------------------------------------------

UniqueId = Union[bytes, Tuple[int, ...]]


def unique_id_bytes(unique_id: UniqueId) -> bytes:
    """The 128 raw bytes of a unique id from either cupy (bytes, or a tuple of signed chars)."""
    if isinstance(unique_id, (bytes, bytearray)):
        raw = bytes(unique_id)
    elif isinstance(unique_id, (tuple, list)):
        if not all(isinstance(x, int) and -128 <= x <= 255 for x in unique_id):
            raise ValueError("an NCCL unique id tuple must hold 128 ints in -128..255 (one char each)")
        raw = bytes(x & 0xFF for x in unique_id)
    else:
        raise TypeError(f"an NCCL unique id is bytes (cupy >= 14) or a tuple of ints (cupy 13), "
                        f"got {type(unique_id).__name__}")
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return raw


def unique_id_for(raw: bytes, as_tuple: bool) -> UniqueId:
    """``raw`` in the form the local cupy's NcclCommunicator takes: bytes, or (cupy 13) the
    tuple of signed chars its get_unique_id returned."""
    raw = unique_id_bytes(raw)
    return struct.unpack(f"{UNIQUE_ID_BYTES}b", raw) if as_tuple else raw
