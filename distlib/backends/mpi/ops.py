"""numpy dtypes and distlib's ReduceOps in MPI's terms.

Reductions run inside MPI (its tuned algorithms), so each (dtype, op) needs an MPI datatype
and an MPI operation that compute what distlib's gloo backend computes (reduce_op.py):

* integers, floats, complex and long double: MPI's predefined types and MPI_SUM, MPI_PROD,
  MPI_MIN, MPI_MAX, MPI_BAND, MPI_BOR, MPI_BXOR (the dtype checks before sending keep each
  op to the types MPI defines it for);
* bool (MPI_C_BOOL): MPI defines only the logical ops on it, which are what distlib's bool
  reductions are: SUM, MAX, BOR → MPI_LOR; PRODUCT, MIN, BAND → MPI_LAND; BXOR → MPI_LXOR;
* float16: MPI has no predefined type for it, so the 2-byte elements travel as
  MPI_UINT16_T and a user-defined MPI operation (created once per op) reduces them with
  numpy's float16 arithmetic;
* AVG is MPI_SUM followed by a division, PREMUL_SUM is MPI_SUM of the scaled input (the
  caller does both, with reduce_op.prepare_input and reduce_op.finish).

Data that is only moved (broadcast, gathers, all_to_all, p2p) travels as MPI_BYTE.
"""

from __future__ import annotations

import threading
from typing import Dict, Tuple

import numpy as np

from ...reduce_op import RedOpType, ReduceOp, accumulate

_TYPE_NAMES = {
    np.dtype(np.bool_): "C_BOOL",
    np.dtype(np.int8): "INT8_T", np.dtype(np.uint8): "UINT8_T",
    np.dtype(np.int16): "INT16_T", np.dtype(np.uint16): "UINT16_T",
    np.dtype(np.int32): "INT32_T", np.dtype(np.uint32): "UINT32_T",
    np.dtype(np.int64): "INT64_T", np.dtype(np.uint64): "UINT64_T",
    np.dtype(np.float32): "FLOAT", np.dtype(np.float64): "DOUBLE", np.dtype(np.longdouble): "LONG_DOUBLE",
    np.dtype(np.complex64): "C_FLOAT_COMPLEX", np.dtype(np.complex128): "C_DOUBLE_COMPLEX",
    np.dtype(np.clongdouble): "C_LONG_DOUBLE_COMPLEX",
    np.dtype(np.float16): "UINT16_T",  # carried as 16-bit words, reduced by a user-defined op
}

_PREDEFINED = {
    RedOpType.SUM: "SUM", RedOpType.AVG: "SUM", RedOpType.PREMUL_SUM: "SUM", RedOpType.PRODUCT: "PROD",
    RedOpType.MIN: "MIN", RedOpType.MAX: "MAX", RedOpType.BAND: "BAND", RedOpType.BOR: "BOR",
    RedOpType.BXOR: "BXOR",
}

_LOGICAL = {
    RedOpType.SUM: "LOR", RedOpType.MAX: "LOR", RedOpType.BOR: "LOR",
    RedOpType.PRODUCT: "LAND", RedOpType.MIN: "LAND", RedOpType.BAND: "LAND",
    RedOpType.BXOR: "LXOR",
}


class OpTable:
    """(dtype, ReduceOp) → (MPI datatype, MPI.Op), for one loaded mpi4py.MPI."""

    def __init__(self, MPI):  # noqa: N803 - the module's own name
        self.MPI = MPI
        self._types = {dt: getattr(MPI, name) for dt, name in _TYPE_NAMES.items()}
        self._cache: Dict[Tuple[np.dtype, RedOpType], Tuple[object, object]] = {}
        self._lock = threading.Lock()

    def datatype(self, dtype: np.dtype):
        return self._types[np.dtype(dtype)]

    def reduction(self, dtype: np.dtype, op: ReduceOp):
        """The MPI datatype and MPI.Op that reduce ``dtype`` arrays as distlib's ``op`` does."""
        key = (np.dtype(dtype), op.op)
        found = self._cache.get(key)
        if found is None:
            with self._lock:
                found = self._cache.get(key) or self._make(*key)
                self._cache[key] = found
        return found

    def _make(self, dtype: np.dtype, op: RedOpType):
        MPI = self.MPI
        if dtype == np.bool_:
            return self._types[dtype], getattr(MPI, _LOGICAL[op])
        if dtype == np.float16:
            return self._types[dtype], MPI.Op.Create(_float16_function(op), commute=True)
        return self._types[dtype], getattr(MPI, _PREDEFINED[op])


def _float16_function(op: RedOpType):
    reduce_op = ReduceOp(op)

    def reduce_float16(inbuf, inoutbuf, datatype):  # MPI's user-function signature
        accumulate(reduce_op, np.frombuffer(inoutbuf, dtype=np.float16), np.frombuffer(inbuf, dtype=np.float16))

    return reduce_float16
