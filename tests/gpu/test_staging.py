"""gloo's cupy path (backends/cuda_staging.py) on CPU: every collective through HostStaged in
real processes, with numpy copies in place of cupy's; the cupy copies themselves run in
test_nccl_gpu.py where a device is."""

import pytest

from tests.collectives.harness import WorkerPool

from . import staging_cases


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def pool(request):
    pool = WorkerPool(request.param)
    yield pool
    pool.close()


def test_every_collective_staged_through_host_copies(pool):
    assert pool.run(staging_cases.every_collective) == [[]] * pool.world_size


def test_the_wrapper_is_the_wrapped_backend(pool):
    assert all(pool.run(staging_cases.with_a_timeout))
