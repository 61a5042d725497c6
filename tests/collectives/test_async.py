"""async_op=True: Work.wait/is_completed/is_success/exception/get_future, and issue order."""

from . import cases


def test_async_operations_run_in_issue_order(pool):
    ws = pool.world_size
    for rank, results in enumerate(pool.run(cases.async_ordering)):
        assert results["value"] == float(ws ** 5), f"rank {rank}: {results}"
        assert results["completed"] and results["future_value_is_array"], results
        assert results["then"] == "chained"
        assert results["sync_after_async"] == ws ** 2
        assert results["broadcast_then_reduce"] == 0.0
