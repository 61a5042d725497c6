"""ReduceOp.PREMUL_SUM carries its factor (torch's _make_nccl_premul_sum): the bare member has
none, and a reduction with it would scale every element by NaN. It is refused before anything
is sent, with the constructor to use."""

import numpy as np
import pytest

import distlib as dist


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("op", [dist.ReduceOp.PREMUL_SUM, dist.ReduceOp.RedOpType.PREMUL_SUM, "premul_sum"],
                         ids=["ReduceOp.PREMUL_SUM", "RedOpType.PREMUL_SUM", "the name"])
def test_premul_sum_without_its_factor_is_refused_and_the_array_untouched(one_rank, op):
    x = np.arange(1, 5, dtype=np.float32)
    with pytest.raises(ValueError, match=r"PREMUL_SUM needs its factor: pass distlib._make_nccl_premul_sum"):
        dist.all_reduce(x, op=op)
    assert x.tolist() == [1.0, 2.0, 3.0, 4.0], f"the array was changed: {x}"


def test_premul_sum_with_its_factor_scales(one_rank):
    x = np.arange(1, 5, dtype=np.float32)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.0))
    assert x.tolist() == [2.0, 4.0, 6.0, 8.0], f"element k should be 2 * (k + 1): {x}"
