"""Bad input fails before anything is sent; disagreement between ranks is raised on every rank."""

import pytest

from . import cases

EXPECTED_TEXT = {
    "non_contiguous": "not contiguous",
    "object_dtype": "dtype object",
    "not_array": "numpy array",
    "bitwise_on_float": "bitwise",
    "avg_on_int": "floating-point",
    "min_on_complex": "complex",
    "list_length": "one per rank",
    "list_dtype": "dtype",
    "rank_out_of_range": "not part of group",
    "output_size": "world_size x input",
    "read_only": "read-only",
    "send_to_self": "self",
    "splits": "entries",
}


def test_bad_input_errors_name_the_problem(pool):
    for rank, errors in enumerate(pool.run(cases.bad_input_errors)):
        if pool.world_size == 1:
            errors.pop("send_to_self")
        assert errors.pop("still_works") is True
        for name, text in errors.items():
            assert EXPECTED_TEXT[name] in text, f"rank {rank}, {name}: {text!r}"


@pytest.mark.parametrize("pool", [2, 3, 4], indirect=True, ids=lambda ws: f"ws{ws}")
@pytest.mark.parametrize("kind,needle", [
    ("shape", "different sizes"),
    ("dtype", "different dtypes"),
    ("collective", "different collectives"),
    ("large_shape", "mismatched collective"),
])
def test_mismatch_between_ranks_raises_on_every_rank(pool, kind, needle):
    for rank, (outcome, elapsed, check) in enumerate(pool.run(cases.mismatched_collectives, kind)):
        assert needle in outcome or "mismatched collective" in outcome, f"rank {rank}: {outcome!r}"
        assert elapsed < 10, f"rank {rank} took {elapsed:.1f}s to notice"
        assert check == pool.world_size  # the default group still works
