"""What NCCL is told about dtypes and reduce ops, the refusals (raised before anything is
enqueued), and the unique id in both of cupy's forms through real stores."""

import importlib.util
import struct
from datetime import timedelta

import numpy as np
import pytest

import distlib as dist
from distlib.backends.nccl import dtypes as T
from distlib.reduce_op import _make_nccl_premul_sum
from tests.fixtures.ports import free_port

R = dist.ReduceOp
NEW, OLD = 23203, 20903


@pytest.mark.parametrize("dtype, nccl_type, view, per_item", [
    ("int8", T.INT8, "int8", 1), ("uint8", T.UINT8, "uint8", 1), ("int32", T.INT32, "int32", 1),
    ("uint32", T.UINT32, "uint32", 1), ("int64", T.INT64, "int64", 1), ("uint64", T.UINT64, "uint64", 1),
    ("float16", T.FLOAT16, "float16", 1), ("float32", T.FLOAT32, "float32", 1),
    ("float64", T.FLOAT64, "float64", 1), ("bool", T.UINT8, "uint8", 1),
    ("complex64", T.FLOAT32, "float32", 2), ("complex128", T.FLOAT64, "float64", 2),
])
def test_every_nccl_type_and_the_mapped_ones(dtype, nccl_type, view, per_item):
    assert T.wire(np.dtype(dtype)) == T.Wire(nccl_type, view, per_item)
    assert T.wire(np.dtype(dtype)).count(7) == 7 * per_item


def test_nccl_enum_values_are_ncclh():
    """The ABI values cupy passes through unchanged (nccl.h), checked against cupy when it is here."""
    assert (T.INT8, T.UINT8, T.INT32, T.UINT32, T.INT64, T.UINT64, T.FLOAT16, T.FLOAT32, T.FLOAT64, T.BFLOAT16) == \
        tuple(range(10))
    assert (T.SUM, T.PROD, T.MAX, T.MIN, T.AVG) == tuple(range(5))
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("cupy not installed: compared with nccl.h's values only")
    from distlib.backends import cupy_env

    nccl = cupy_env.status().nccl
    if nccl is None:
        pytest.skip(cupy_env.status().problem)
    assert [nccl.NCCL_INT8, nccl.NCCL_UINT8, nccl.NCCL_INT32, nccl.NCCL_UINT32, nccl.NCCL_INT64, nccl.NCCL_UINT64,
            nccl.NCCL_FLOAT16, nccl.NCCL_FLOAT32, nccl.NCCL_FLOAT64, nccl.NCCL_BFLOAT16] == list(range(10))
    assert [nccl.NCCL_SUM, nccl.NCCL_PROD, nccl.NCCL_MAX, nccl.NCCL_MIN, nccl.NCCL_AVG] == list(range(5))


class _Bfloat16:
    """A dtype-like object named bfloat16, as ml_dtypes' is (numpy has none)."""

    name = "bfloat16"


def test_bfloat16_is_detected_by_name():
    assert T.is_bfloat16(_Bfloat16()) and not T.is_bfloat16(np.dtype("float16"))
    assert T.wire(_Bfloat16()) == T.Wire(T.BFLOAT16, "bfloat16", 1)
    assert T.reduction(_Bfloat16(), R.SUM, NEW) == T.Reduction(T.Wire(T.BFLOAT16, "bfloat16", 1), T.SUM, None, False)


@pytest.mark.parametrize("dtype", ["int16", "uint16", "longdouble", "clongdouble"])
def test_types_nccl_lacks_are_refused_in_torchs_words(dtype):
    with pytest.raises(TypeError, match=f"Input tensor data type is not supported for NCCL process group: "
                                        f"{np.dtype(dtype).name}"):
        T.wire(np.dtype(dtype))
    with pytest.raises(TypeError, match="not supported for NCCL"):
        T.reduction(np.dtype(dtype), R.SUM, NEW)


@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR"])
@pytest.mark.parametrize("dtype", ["int32", "bool", "uint8"])
def test_bitwise_ops_are_refused_naming_op_and_backend(op, dtype):
    with pytest.raises(ValueError, match=rf"^Cannot use ReduceOp\.{op} with NCCL: NCCL has no bitwise reductions"):
        T.reduction(np.dtype(dtype), getattr(R, op), NEW)


def test_bool_reduces_as_logical_ops_on_uint8():
    uint8 = T.Wire(T.UINT8, "uint8", 1)
    assert T.reduction(np.dtype(bool), R.SUM, NEW) == T.Reduction(uint8, T.MAX, None, False)
    assert T.reduction(np.dtype(bool), R.MAX, NEW) == T.Reduction(uint8, T.MAX, None, False)
    assert T.reduction(np.dtype(bool), R.PRODUCT, NEW) == T.Reduction(uint8, T.MIN, None, False)
    assert T.reduction(np.dtype(bool), R.MIN, NEW) == T.Reduction(uint8, T.MIN, None, False)
    with pytest.raises(TypeError, match="Cannot use ReduceOp.AVG with boolean inputs"):
        T.reduction(np.dtype(bool), R.AVG, NEW)


def test_complex_reduces_as_float_pairs_for_sum_and_avg_only():
    pairs = T.Wire(T.FLOAT32, "float32", 2)
    assert T.reduction(np.dtype(np.complex64), R.SUM, NEW) == T.Reduction(pairs, T.SUM, None, False)
    assert T.reduction(np.dtype(np.complex64), R.AVG, NEW) == T.Reduction(pairs, T.AVG, None, False)
    assert T.reduction(np.dtype(np.complex64), _make_nccl_premul_sum(0.5), NEW) == \
        T.Reduction(pairs, T.SUM, 0.5, False)
    with pytest.raises(TypeError, match=r"Cannot use ReduceOp\.PRODUCT on complex64 with NCCL: .* pairs of floats"):
        T.reduction(np.dtype(np.complex64), R.PRODUCT, NEW)


def test_avg_is_native_from_nccl_2_10_else_sum_and_divide():
    f32 = T.Wire(T.FLOAT32, "float32", 1)
    assert T.reduction(np.dtype(np.float32), R.AVG, 21000) == T.Reduction(f32, T.AVG, None, False)
    assert T.reduction(np.dtype(np.float32), R.AVG, 20907) == T.Reduction(f32, T.SUM, None, True)
    assert T.reduction(np.dtype(np.float32), R.PRODUCT, NEW) == T.Reduction(f32, T.PROD, None, False)
    assert T.reduction(np.dtype(np.float32), R.MIN, NEW).nccl_op == T.MIN
    assert T.reduction(np.dtype(np.float32), R.MAX, NEW).nccl_op == T.MAX


# -- the unique id --------------------------------------------------------------------------------

RAW = bytes((i * 37 + 11) % 256 for i in range(128))
AS_TUPLE = struct.unpack("128b", RAW)  # what cupy 13's get_unique_id returns for these bytes


def test_unique_id_both_forms_are_the_same_bytes():
    assert T.unique_id_bytes(RAW) == RAW
    assert T.unique_id_bytes(AS_TUPLE) == RAW
    assert all(-128 <= x <= 127 for x in AS_TUPLE) and min(AS_TUPLE) < 0
    assert T.unique_id_for(RAW, as_tuple=True) == AS_TUPLE
    assert T.unique_id_for(AS_TUPLE, as_tuple=False) == RAW


@pytest.mark.parametrize("bad, error", [(b"x" * 127, ValueError), ((1,) * 129, ValueError), ((300,) * 128, ValueError),
                                        ("abc", TypeError)])
def test_malformed_unique_ids_are_refused(bad, error):
    with pytest.raises(error, match="unique id"):
        T.unique_id_bytes(bad)


def _stores():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
    return [(dist.HashStore(), None), (master, client)]


@pytest.mark.parametrize("given", [RAW, AS_TUPLE], ids=["bytes(cupy14)", "tuple(cupy13)"])
def test_unique_id_travels_through_real_stores_to_either_cupy(given):
    """Rank 0 publishes whatever its cupy returned; a rank with the other cupy gets its own form."""
    for writer, reader in _stores():
        reader = reader or writer
        writer.set("uid", T.unique_id_bytes(given).hex())
        raw = bytes.fromhex(reader.get("uid").decode())
        assert T.unique_id_for(raw, as_tuple=False) == RAW
        assert T.unique_id_for(raw, as_tuple=True) == AS_TUPLE


def test_a_real_unique_id_from_the_installed_cupy():
    """ncclGetUniqueId needs no device: the installed cupy's id, whatever its form, round-trips."""
    from distlib.backends import cupy_env

    found = cupy_env.status()
    if found.nccl is None:
        pytest.skip(found.problem)
    uid = found.nccl.get_unique_id()
    raw = T.unique_id_bytes(uid)
    assert len(raw) == 128 and any(raw)
    assert T.unique_id_for(raw, as_tuple=cupy_env.cupy_major(found.cupy) < 14) == uid
