"""Bad input fails before anything is sent; disagreement between ranks is raised on every rank."""

import pytest

from . import cases
from .bad_input_texts import EXPECTED_TEXT


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
