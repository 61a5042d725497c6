"""``ReduceOp`` and the element-wise kernels behind it.

The members are torch's: SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG, PREMUL_SUM. On bool
arrays SUM and MAX are logical or, PRODUCT and MIN logical and (what summing or multiplying
0/1 values and casting back gives). Bitwise ops need integer or bool arrays; AVG needs a
floating-point (or complex) dtype; MIN and MAX reject complex numbers (no order). Each
rule is checked before anything is sent. PREMUL_SUM multiplies each rank's input by a
factor first (``_make_nccl_premul_sum(factor)``, as torch spells it).
"""

from __future__ import annotations

import enum
from typing import ClassVar, Optional, Union

import numpy as np


class RedOpType(enum.IntEnum):
    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8


#: The enum under a name the class body below does not shadow (ReduceOp.RedOpType is torch's).
_OpType = RedOpType


class ReduceOp:
    """torch.distributed.ReduceOp: ``ReduceOp.SUM`` etc.; compare with ``==``."""

    RedOpType = RedOpType

    # one instance per member, set after the class (below)
    SUM: ClassVar["ReduceOp"]
    AVG: ClassVar["ReduceOp"]
    PRODUCT: ClassVar["ReduceOp"]
    MIN: ClassVar["ReduceOp"]
    MAX: ClassVar["ReduceOp"]
    BAND: ClassVar["ReduceOp"]
    BOR: ClassVar["ReduceOp"]
    BXOR: ClassVar["ReduceOp"]
    PREMUL_SUM: ClassVar["ReduceOp"]

    def __init__(self, op: Union[_OpType, "ReduceOp"], factor: Optional[float] = None):
        self.op: _OpType = RedOpType(op.op if isinstance(op, ReduceOp) else op)
        self.factor = factor

    def __eq__(self, other) -> bool:
        if isinstance(other, ReduceOp):
            return self.op == other.op
        if isinstance(other, RedOpType):
            return self.op == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.op)

    def __repr__(self) -> str:
        if self.op == RedOpType.PREMUL_SUM:
            return f"ReduceOp.PREMUL_SUM(factor={self.factor})"
        return f"ReduceOp.{self.op.name}"

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def code(self) -> int:
        """Code for frame headers (never 0: 0 means 'no reduction')."""
        return int(self.op) + 1


for _member in RedOpType:
    setattr(ReduceOp, _member.name, ReduceOp(_member))


def _make_nccl_premul_sum(factor: float) -> ReduceOp:
    """torch's constructor for PREMUL_SUM: sum of ``factor * input`` over the ranks."""
    return ReduceOp(RedOpType.PREMUL_SUM, float(factor))


def as_reduce_op(op) -> ReduceOp:
    """``op`` as a ReduceOp; PREMUL_SUM only with its factor (a missing one would scale by NaN)."""
    if isinstance(op, ReduceOp):
        if op.op is RedOpType.PREMUL_SUM and op.factor is None:
            raise ValueError(_NO_FACTOR)
        return op
    if isinstance(op, RedOpType) or (isinstance(op, str) and op.upper() in RedOpType.__members__):
        member = op if isinstance(op, RedOpType) else RedOpType[op.upper()]
        if member is RedOpType.PREMUL_SUM:
            raise ValueError(_NO_FACTOR)
        return ReduceOp(member)
    raise TypeError(f"op must be a distlib.ReduceOp (e.g. ReduceOp.SUM), got {op!r}")


_NO_FACTOR = ("ReduceOp.PREMUL_SUM needs its factor: pass distlib._make_nccl_premul_sum(factor) (torch's "
              "constructor), not ReduceOp.PREMUL_SUM itself")


def check_op_for_dtype(op: ReduceOp, dtype: np.dtype, what: str = "the array") -> None:
    """Raise TypeError when ``op`` is undefined for ``dtype`` (before anything is sent)."""
    kind = np.dtype(dtype).kind
    name = op.name
    if op.op in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR) and kind not in "iub":
        raise TypeError(f"ReduceOp.{name} is a bitwise op: it needs an integer or bool array, but {what} is {dtype}")
    if op.op == RedOpType.AVG and kind not in "fc":
        raise TypeError(f"ReduceOp.AVG needs a floating-point array (an average of {dtype} would be truncated); "
                        f"{what} is {dtype}: cast it to float first")
    if op.op in (RedOpType.MIN, RedOpType.MAX) and kind == "c":
        raise TypeError(f"ReduceOp.{name} is undefined for complex numbers ({what} is {dtype})")
    if op.op == RedOpType.PREMUL_SUM and kind not in "fc":
        raise TypeError(f"ReduceOp.PREMUL_SUM needs a floating-point array; {what} is {dtype}")


_BOOL_KERNELS = {
    RedOpType.SUM: np.logical_or, RedOpType.MAX: np.logical_or, RedOpType.BOR: np.logical_or,
    RedOpType.PRODUCT: np.logical_and, RedOpType.MIN: np.logical_and, RedOpType.BAND: np.logical_and,
    RedOpType.BXOR: np.logical_xor,
}
_KERNELS = {
    RedOpType.SUM: np.add, RedOpType.AVG: np.add, RedOpType.PREMUL_SUM: np.add,
    RedOpType.PRODUCT: np.multiply, RedOpType.MIN: np.minimum, RedOpType.MAX: np.maximum,
    RedOpType.BAND: np.bitwise_and, RedOpType.BOR: np.bitwise_or, RedOpType.BXOR: np.bitwise_xor,
}


def kernel(op: ReduceOp, dtype: np.dtype):
    """The ufunc that combines two arrays of ``dtype`` under ``op``."""
    return (_BOOL_KERNELS if dtype == np.bool_ else _KERNELS)[op.op]


def accumulate(op: ReduceOp, acc: np.ndarray, other: np.ndarray) -> None:
    """``acc = acc (op) other``, in place. Both arrays are flat views of the same dtype."""
    kernel(op, acc.dtype)(acc, other, out=acc)


def combine(op: ReduceOp, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a (op) b``."""
    kernel(op, out.dtype)(a, b, out=out)


def prepare_input(op: ReduceOp, array: np.ndarray) -> np.ndarray:
    """PREMUL_SUM: the scaled copy a rank contributes; every other op: the array itself."""
    if op.op == RedOpType.PREMUL_SUM:
        return (array * array.dtype.type(op.factor)).astype(array.dtype, copy=False)
    return array


def finish(op: ReduceOp, result: np.ndarray, world_size: int) -> None:
    """AVG: divide the sum by the number of ranks, in place."""
    if op.op == RedOpType.AVG:
        np.divide(result, world_size, out=result, casting="unsafe")
