"""A 200-request mixed batch of the conversation trace (workload layer, lengths / 64) runs
to completion through the scheduler with prefix reuse reported (done-when of issue #5)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from pymooncake.bench.engine import run_trace_batch  # noqa: E402


@pytest.mark.slow
def test_200_request_trace_batch_runs_to_completion_with_prefix_reuse() -> None:
    r = run_trace_batch(num_requests=200, scale=64)
    assert r["num_requests"] == r["num_finished"] == 200
    assert r["output_tokens"] == 1219  # sum of ceil(output_length / 64) over the 200 requests
    # concurrent admission can only lose hits against an infinite arrival-order cache
    assert 0 < r["blocks_reused"] <= r["ideal_blocks_reused"] == 322
    assert r["blocks_total"] == 5357


def test_sequential_trace_reuse_equals_infinite_cache_replay() -> None:
    # one request at a time, cache large enough: every reusable full block is reused
    r = run_trace_batch(num_requests=60, scale=64, num_kv_blocks=8192, sequential=True)
    assert r["num_finished"] == 60
    assert r["blocks_reused"] == r["ideal_blocks_reused"] == 59
