"""One pool of rank processes per world size, shared by every test that asks for it."""

import pytest

from .harness import WorkerPool

WORLD_SIZES = [1, 2, 3, 4]


@pytest.fixture(scope="session", params=WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def pool(request):
    pool = WorkerPool(request.param)
    yield pool
    pool.close()
