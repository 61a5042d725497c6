"""What an array must be to take part in a collective, checked before anything is sent.

torch checks tensors before a collective starts; distlib does the same for numpy and cupy
arrays: C-contiguous, a numeric or bool dtype (bfloat16 too, for the nccl backend), writable
where the operation writes (cupy arrays always are), all on one kind of device. A failed
check raises at once, names the argument and says what to do, and nothing has gone on the
wire, so the other ranks are not left half-way.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np

# Codes for frame headers (frames.py): the receiver checks the sender's dtype against its own.
_DTYPES = [
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128, np.longdouble, np.clongdouble,
]
DTYPE_CODES = {np.dtype(t): i + 1 for i, t in enumerate(_DTYPES)}
DTYPE_BY_CODE = {code: dt for dt, code in DTYPE_CODES.items()}


def dtype_code(dtype: np.dtype) -> int:
    return DTYPE_CODES.get(np.dtype(dtype), 0)


def dtype_name(code: int) -> str:
    dt = DTYPE_BY_CODE.get(code)
    return "bytes" if dt is None else dt.name


def device_of(array: Any) -> str:
    """'cpu' for numpy arrays, 'cuda' for cupy arrays."""
    module = type(array).__module__
    if module.startswith("cupy"):
        return "cuda"
    return "cpu"


def _check_cupy_array(array: Any, name: str) -> Any:
    if type(array).__name__ != "ndarray":
        raise TypeError(f"{name} must be a cupy.ndarray (or a numpy array), got {type(array).__module__}."
                        f"{type(array).__name__}")
    if array.dtype not in DTYPE_CODES and array.dtype.name != "bfloat16":
        raise TypeError(
            f"{name} has dtype {array.dtype}, which collectives do not support: use a numeric or bool dtype")
    if not array.flags.c_contiguous:
        raise ValueError(
            f"{name} is not contiguous (shape {array.shape}, strides {array.strides}): "
            f"pass cupy.ascontiguousarray({name}) and copy the result back if you need it in place")
    return array


def check_array(array: Any, name: str, writable: bool = False) -> np.ndarray:
    """Raise TypeError/ValueError unless ``array`` can take part in a collective."""
    if type(array) is np.ndarray:  # the common case in one look at the flags (a small collective's ~10 %)
        flags = array.flags
        if flags.c_contiguous and (flags.writeable or not writable) and array.dtype in DTYPE_CODES:
            return array
    if device_of(array) == "cuda":
        return _check_cupy_array(array, name)
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy array (or a cupy array on GPU), got {type(array).__name__}")
    if array.dtype not in DTYPE_CODES:
        raise TypeError(
            f"{name} has dtype {array.dtype}, which collectives do not support: use a numeric or bool dtype")
    if not array.flags.c_contiguous:
        raise ValueError(
            f"{name} is not contiguous (shape {array.shape}, strides {array.strides}): "
            f"pass np.ascontiguousarray({name}) and copy the result back if you need it in place")
    if writable and not array.flags.writeable:
        raise ValueError(f"{name} is read-only, but this operation writes its result into it")
    return array


def check_array_list(arrays: Sequence[Any], name: str, length: int, writable: bool = False) -> List[np.ndarray]:
    if not isinstance(arrays, (list, tuple)):
        raise TypeError(f"{name} must be a list of arrays, got {type(arrays).__name__}")
    if len(arrays) != length:
        raise ValueError(f"{name} has {len(arrays)} arrays, but the group has {length} ranks: pass one per rank")
    return [check_array(a, f"{name}[{i}]", writable) for i, a in enumerate(arrays)]


def same_dtype(arrays: Sequence[np.ndarray], reference: np.ndarray, name: str, ref_name: str) -> None:
    for i, a in enumerate(arrays):
        if a.dtype != reference.dtype:
            raise TypeError(f"{name}[{i}] has dtype {a.dtype} but {ref_name} has {reference.dtype}: they must match")


def check_one_device(reference: Any, *others: Any) -> str:
    """The device of ``reference`` ("cpu" or "cuda"), after checking that every other array of
    the operation (arrays, lists of arrays, None) is on the same kind: it picks the backend."""
    device = "cpu" if type(reference) is np.ndarray else device_of(reference)
    for other in others:
        for item in (other if isinstance(other, (list, tuple)) else (other,)):
            if item is None or (type(item) is np.ndarray and device == "cpu"):
                continue  # the common case, decided without device_of's string test
            if device_of(item) != device:
                raise TypeError(f"one operation's arrays must all be numpy arrays or all cupy arrays, but it has "
                                f"a {device_of(item)} array ({type(item).__module__}.{type(item).__name__}) "
                                f"beside a {device} one")
    return device
