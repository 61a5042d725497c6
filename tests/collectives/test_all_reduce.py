"""all_reduce: every ReduceOp x every dtype x sizes (empty, one element, counts not divisible
by the world size, sizes that take the direct, ring and shared-memory paths) x world sizes
1-4, each checked on every rank against a numpy reference, and bit-identical across ranks."""

import pytest

from . import cases

OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"]


@pytest.mark.parametrize("op_name", OPS)
def test_all_reduce_matches_numpy(pool, op_name):
    per_rank = pool.run(cases.all_reduce_matrix, op_name, cases.ALL_DTYPES, cases.SIZES)
    wrong = [(rank, dtype, n) for rank, rows in enumerate(per_rank) for dtype, n, ok, _ in rows if not ok]
    assert not wrong, f"{op_name}: results differ from numpy at (rank, dtype, size): {wrong[:10]}"
    digests = [[d for _, _, _, d in rows] for rows in per_rank]
    assert all(d == digests[0] for d in digests), f"{op_name}: ranks hold different results"
    assert len(per_rank[0]) == sum(cases.valid(op_name, d) for d in cases.ALL_DTYPES) * len(cases.SIZES)
