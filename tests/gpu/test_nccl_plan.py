"""Every collective's NCCL plan, run for all ranks through a numpy model of NCCL's primitives
(tests/gpu/nccl_model.py) and checked against numpy references: every op x dtype the nccl
backend accepts, world sizes 1-4, NCCL with and without a native AVG."""

import numpy as np
import pytest

from distlib.backends.nccl import dtypes as T
from distlib.backends.nccl import plan as P
from distlib.reduce_op import _make_nccl_premul_sum, as_reduce_op, check_op_for_dtype
from tests.collectives.cases import close, make_input, reference

from . import nccl_model

DTYPES = ["bool", "int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
          "complex64", "complex128"]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"]
SIZES = [1, 2, 3, 4]
NEW_NCCL, OLD_NCCL = 23203, 20903  # 2.32.3 has ncclAvg, 2.9.3 does not
COUNT = 5


def _op(name):
    return _make_nccl_premul_sum(2.0) if name == "PREMUL_SUM" else as_reduce_op(name)


def _accepted(dtype, name, version=NEW_NCCL):
    """The Reduction, or None where distlib or NCCL refuses the pair (tested elsewhere)."""
    op = _op(name)
    try:
        check_op_for_dtype(op, np.dtype(dtype))
        return T.reduction(np.dtype(dtype), op, version)
    except (TypeError, ValueError):
        return None


def _cases():
    for dtype in DTYPES:
        for name in OPS:
            for version in (NEW_NCCL, OLD_NCCL):
                if _accepted(dtype, name, version) is not None and (version == NEW_NCCL or name == "AVG"):
                    yield dtype, name, version


def _check(got, want, label):
    assert got.dtype == want.dtype, label
    if got.dtype == np.bool_:  # a bool must hold 0 or 1 (a uint8 SUM would leave 2, 3, ...)
        assert got.view(np.uint8).max(initial=0) <= 1, f"{label}: bool bytes {got.view(np.uint8)}"
    assert close(got, want), f"{label}: got {got}, want {want}"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype, name, version", list(_cases()))
def test_reductions(dtype, name, version, size):
    how = T.reduction(np.dtype(dtype), _op(name), version)
    inputs = [make_input(r, dtype, COUNT * size, name) for r in range(size)]
    want = reference(name, inputs)

    arrays = [[x.copy()] for x in inputs]
    nccl_model.run([P.all_reduce(how, x.size, size) for x in inputs], arrays)
    for r in range(size):
        _check(arrays[r][0], want, f"all_reduce rank {r}")

    for root in range(size):
        arrays = [[x.copy()] for x in inputs]
        nccl_model.run([P.reduce(how, x.size, root, r, size) for r, x in enumerate(inputs)], arrays)
        for r in range(size):
            _check(arrays[r][0], want if r == root else inputs[r], f"reduce to {root}, rank {r}")

    outs = [np.zeros(COUNT, dtype) for _ in range(size)]
    nccl_model.run([P.reduce_scatter_into(how, COUNT, size) for _ in range(size)],
                   [[outs[r], inputs[r].copy()] for r in range(size)])
    for r in range(size):
        _check(outs[r], want[r * COUNT:(r + 1) * COUNT], f"reduce_scatter_tensor rank {r}")

    outs = [np.zeros(COUNT, dtype) for _ in range(size)]
    lists = [[inputs[r][k * COUNT:(k + 1) * COUNT].copy() for k in range(size)] for r in range(size)]
    nccl_model.run([P.reduce_scatter(how, COUNT, size) for _ in range(size)],
                   [[outs[r], *lists[r]] for r in range(size)])
    for r in range(size):
        _check(outs[r], want[r * COUNT:(r + 1) * COUNT], f"reduce_scatter rank {r}")
        for k in range(size):  # inputs untouched (PREMUL_SUM scales a copy)
            _check(lists[r][k], inputs[r][k * COUNT:(k + 1) * COUNT], "reduce_scatter input")


def test_premul_sum_leaves_reduce_inputs_alone():
    how = T.reduction(np.dtype("float32"), _op("PREMUL_SUM"), NEW_NCCL)
    inputs = [np.arange(4, dtype=np.float32) + r for r in range(3)]
    arrays = [[x.copy()] for x in inputs]
    nccl_model.run([P.reduce(how, 4, 0, r, 3) for r in range(3)], arrays)
    np.testing.assert_array_equal(arrays[0][0], 2 * sum(inputs))
    np.testing.assert_array_equal(arrays[1][0], inputs[1])
    np.testing.assert_array_equal(arrays[2][0], inputs[2])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_data_movement(dtype, size):
    wire = T.wire(np.dtype(dtype))
    inputs = [make_input(r, dtype, COUNT) for r in range(size)]

    for root in range(size):
        arrays = [[x.copy()] for x in inputs]
        nccl_model.run([P.broadcast(wire, COUNT, root) for _ in range(size)], arrays)
        for r in range(size):
            _check(arrays[r][0], inputs[root], f"broadcast from {root}")

    outs = [np.zeros(COUNT * size, dtype) for _ in range(size)]
    nccl_model.run([P.all_gather_into(wire, COUNT, size) for _ in range(size)],
                   [[outs[r], inputs[r]] for r in range(size)])
    for r in range(size):
        _check(outs[r], np.concatenate(inputs), "all_gather_into_tensor")

    lists = [[np.zeros(COUNT, dtype) for _ in range(size)] for _ in range(size)]
    nccl_model.run([P.all_gather(wire, COUNT, size) for _ in range(size)],
                   [[inputs[r], *lists[r]] for r in range(size)])
    for r in range(size):
        for k in range(size):
            _check(lists[r][k], inputs[k], f"all_gather rank {r} slot {k}")

    for root in range(size):
        gathered = [np.zeros(COUNT, dtype) for _ in range(size)]
        nccl_model.run([P.gather(wire, COUNT, root, r, size) for r in range(size)],
                       [[inputs[r], *gathered] if r == root else [inputs[r]] for r in range(size)])
        for k in range(size):
            _check(gathered[k], inputs[k], f"gather to {root} slot {k}")

        pieces = [make_input(50 + k, dtype, COUNT) for k in range(size)]
        outs = [np.zeros(COUNT, dtype) for _ in range(size)]
        nccl_model.run([P.scatter(wire, COUNT, root, r, size) for r in range(size)],
                       [[outs[r], *pieces] if r == root else [outs[r]] for r in range(size)])
        for r in range(size):
            _check(outs[r], pieces[r], f"scatter from {root} rank {r}")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", ["float32", "complex128", "bool"])
def test_all_to_all_with_uneven_sizes(dtype, size):
    wire = T.wire(np.dtype(dtype))
    # rank r sends (r + k) % 3 elements to rank k (some empty)
    counts = [[(r + k) % 3 for k in range(size)] for r in range(size)]
    sent = [[make_input(10 * r + k, dtype, counts[r][k]) for k in range(size)] for r in range(size)]
    received = [[np.zeros(counts[k][r], dtype) for k in range(size)] for r in range(size)]
    nccl_model.run([P.all_to_all(wire, [counts[k][r] for k in range(size)], counts[r], r) for r in range(size)],
                   [[*received[r], *sent[r]] for r in range(size)])
    for r in range(size):
        for k in range(size):
            _check(received[r][k], sent[k][r], f"all_to_all {k}->{r}")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("row", [(), (3,), (2, 2)])
def test_all_to_all_single_with_split_sizes(row, size):
    wire = T.wire(np.dtype("complex64"))
    per_row = int(np.prod(row)) if row else 1
    splits = [[(r * 2 + k) % 4 for k in range(size)] for r in range(size)]  # rows rank r sends to k
    inputs = [make_input(r, "complex64", sum(splits[r]) * per_row).reshape((sum(splits[r]), *row))
              for r in range(size)]
    out_splits = [[splits[k][r] for k in range(size)] for r in range(size)]
    outputs = [np.zeros((sum(out_splits[r]), *row), np.complex64) for r in range(size)]
    nccl_model.run([P.all_to_all_single(wire, out_splits[r], splits[r], per_row, per_row, r) for r in range(size)],
                   [[outputs[r], inputs[r]] for r in range(size)])
    for r in range(size):
        want = []
        for k in range(size):
            start = sum(splits[k][:r])
            want.append(inputs[k][start:start + splits[k][r]])
        _check(outputs[r], np.concatenate(want), f"all_to_all_single rank {r}")


def test_split_regions_are_consecutive_rows():
    assert P.split_regions(1, [2, 0, 3], 4) == [P.Region(1, 0, 8), P.Region(1, 8, 0), P.Region(1, 8, 12)]


def test_point_to_point_and_batches():
    wire = T.wire(np.dtype("int64"))
    data, box = np.arange(6, dtype=np.int64), np.zeros(6, np.int64)
    nccl_model.run([P.send(wire, 6, 1), P.recv(wire, 6, 0)], [[data], [box]])
    np.testing.assert_array_equal(box, data)

    size = 3  # a ring: every rank sends to the next and receives from the previous, in one group
    sent = [np.full(4, r, np.float64) for r in range(size)]
    got = [np.zeros(4, np.float64) for _ in range(size)]
    byte = T.Wire(T.UINT8, "uint8", 1)
    nccl_model.run([P.batch_p2p(byte, [(False, 32, (r - 1) % size), (True, 32, (r + 1) % size)]) for r in range(size)],
                   [[got[r], sent[r]] for r in range(size)])
    for r in range(size):
        np.testing.assert_array_equal(got[r], sent[(r - 1) % size])


def test_barrier_is_one_all_reduce_on_a_temporary():
    plan = P.barrier(T.Wire(T.UINT8, "uint8", 1))
    assert plan.buffers == 0 and plan.temps == [1]
    assert [type(s) for s in plan.steps] == [P.AllReduce]
    nccl_model.run([plan, P.barrier(T.Wire(T.UINT8, "uint8", 1))], [[], []])


def test_the_model_catches_a_plan_that_disagrees():
    """The oracle is not vacuous: ranks whose plans differ, or whose sends and receives do not
    match, fail."""
    wire = T.wire(np.dtype("float32"))
    with pytest.raises(AssertionError, match="disagree"):
        nccl_model.run([P.broadcast(wire, 2, 0), P.all_gather_into(wire, 1, 2)],
                       [[np.zeros(2, np.float32)], [np.zeros(2, np.float32), np.zeros(1, np.float32)]])
    with pytest.raises(AssertionError, match="send of 3, receive of 2"):
        nccl_model.run([P.send(wire, 3, 1), P.recv(wire, 2, 0)], [[np.zeros(3, np.float32)], [np.zeros(2, np.float32)]])
