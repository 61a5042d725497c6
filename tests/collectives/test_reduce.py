"""reduce (to the first and last rank) and reduce_scatter / reduce_scatter_tensor against numpy."""

import pytest

from . import cases

OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BXOR", "AVG", "PREMUL_SUM"]
DTYPES = ["bool", "int8", "int32", "uint64", "float16", "float32", "float64", "complex64"]
SIZES = [0, 1, 7, 1003, 300_007]


@pytest.mark.parametrize("op_name", OPS)
def test_reduce_to_each_end(pool, op_name):
    for root in sorted({0, pool.world_size - 1}):
        per_rank = pool.run(cases.reduce_matrix, op_name, DTYPES, SIZES, root)
        wrong = [(rank, dtype, n) for rank, rows in enumerate(per_rank) for dtype, n, ok in rows if not ok]
        assert not wrong, f"reduce {op_name} to rank {root}: wrong at (rank, dtype, size) {wrong[:10]}"


@pytest.mark.parametrize("op_name", OPS)
def test_reduce_scatter_both_forms(pool, op_name):
    per_rank = pool.run(cases.reduce_scatter_matrix, op_name, DTYPES, [0, 1, 5, 80_003])
    wrong = [(rank, dtype, n, t, lst) for rank, rows in enumerate(per_rank) for dtype, n, t, lst in rows
             if not (t and lst)]
    assert not wrong, f"reduce_scatter {op_name}: (rank, dtype, size, tensor ok, list ok) {wrong[:10]}"
