"""conductor.policy.cpp: the CPP cost model and when a prompt goes to the CPP group."""

from __future__ import annotations

import pytest

from pymooncake.conductor.policy.cpp import (
    CPP_BREAK_EVEN_TOKENS,
    CppCostModel,
    break_even_tokens,
    cpp_prefill_s,
    single_prefill_s,
    use_cpp,
)
from pymooncake.conductor.policy.estimators import PrefillEstimator

LINEAR = PrefillEstimator(quadratic_s=0.0, linear_s=1e-3)


def _model(*args: object, **kw: object) -> CppCostModel:
    """A cost model with equal chunks unless ``edge_tokens`` is given."""
    kw.setdefault("edge_tokens", 0)
    return CppCostModel(*args, **kw)  # type: ignore[arg-type]


def test_one_stage_is_the_single_worker_plus_overhead() -> None:
    m = _model(num_stages=1, chunk_tokens=512, single=LINEAR, hop_s=0.5, overhead_s=0.0)
    for n in (1, 511, 512, 4096, 5000):
        assert cpp_prefill_s(m, n) == pytest.approx(single_prefill_s(m, n))


def test_pipeline_makespan_is_share_plus_fill_drain_plus_hops() -> None:
    m = _model(num_stages=2, chunk_tokens=512, single=LINEAR, hop_s=0.01, overhead_s=0.0)
    # 8 equal chunks of 0.512 s: stage 0 busy 8 x 0.256, the last chunk hops (0.01) and
    # takes 0.256 on stage 1 (stage 1 never waits on itself: it is no slower than stage 0)
    assert cpp_prefill_s(m, 4096) == pytest.approx(8 * 0.256 + 0.01 + 0.256)
    assert cpp_prefill_s(m, 4096) / single_prefill_s(m, 4096) == pytest.approx(0.5645, abs=1e-3)
    # a quadratic term makes later chunks dearer: the drain is the last (dearest) chunk
    q = _model(2, 512, PrefillEstimator(1e-7, 1e-3), 0.0, 0.0)
    t, single = cpp_prefill_s(q, 4096), single_prefill_s(q, 4096)
    last = (PrefillEstimator(1e-7, 1e-3).prefill_s(4096) - PrefillEstimator(1e-7, 1e-3)
            .prefill_s(3584)) / 2
    assert t == pytest.approx(single / 2 + last)


def test_one_chunk_never_pays_and_prefix_is_skipped() -> None:
    m = _model(2, 512, LINEAR, hop_s=0.003, overhead_s=0.002)
    assert cpp_prefill_s(m, 512) > single_prefill_s(m, 512)
    assert cpp_prefill_s(m, 4096, 4096) == 0.0
    # only the uncached tokens flow: 1024 new tokens after a 3072-token prefix
    assert cpp_prefill_s(m, 4096, 3072) == pytest.approx(
        cpp_prefill_s(_model(2, 512, LINEAR, 0.003, 0.002), 1024))


def test_break_even_from_the_model() -> None:
    m = _model(2, 512, LINEAR, hop_s=0.003, overhead_s=0.002, min_prompt_tokens=0)
    be = break_even_tokens(m)
    assert be is not None and 512 < be < 600
    assert all(cpp_prefill_s(m, n) < single_prefill_s(m, n) for n in range(be, 8192, 16))
    assert cpp_prefill_s(m, be - 16) >= single_prefill_s(m, be - 16)
    slow = _model(2, 512, LINEAR, hop_s=0.2, overhead_s=0.0, min_prompt_tokens=0)
    assert break_even_tokens(slow) > be  # a slower hop moves the break-even up
    assert break_even_tokens(_model(2, 512, LINEAR, hop_s=100.0)) is None


def test_use_cpp() -> None:
    m = _model(2, 512, LINEAR, hop_s=0.003, overhead_s=0.002, min_prompt_tokens=1024)
    assert use_cpp(4096, 0, m)
    assert not use_cpp(1000, 0, m)  # below the measured break-even
    assert not use_cpp(4096, 3500, m)  # only 596 uncached tokens
    assert not use_cpp(4096, 0, m, single_queue_s=0.0, cpp_queue_s=10.0)  # group busy
    assert use_cpp(4096, 0, m, single_queue_s=10.0, cpp_queue_s=0.0)
    assert not use_cpp(8192, 0, _model(1, 512, LINEAR, min_prompt_tokens=0))
    assert CppCostModel().min_prompt_tokens == CPP_BREAK_EVEN_TOKENS


def test_model_validation() -> None:
    with pytest.raises(ValueError):
        _model(num_stages=0)
    with pytest.raises(ValueError):
        _model(hop_s=-1.0)


def test_edge_chunks_shorten_fill_and_drain() -> None:
    from pymooncake.conductor.policy.cpp import chunk_sizes
    assert chunk_sizes(1100, 512) == [512, 512, 76]
    sizes = chunk_sizes(4096, 512, 128)
    assert sizes[0] == 128 and sizes[-4:] == [128] * 4 and sum(sizes) == 4096
    assert chunk_sizes(1024, 512, 128) == [512, 512]  # not longer than two chunks
    q = PrefillEstimator(1e-7, 1e-3)
    plain = _model(2, 512, q, 0.003, 0.0)
    edged = _model(2, 512, q, 0.003, 0.0, edge_tokens=128)
    assert cpp_prefill_s(edged, 4096) < cpp_prefill_s(plain, 4096)


def test_chunk_sizes_match_the_group() -> None:
    pytest.importorskip("torch")
    from pymooncake.conductor.policy.cpp import chunk_sizes
    from pymooncake.engine.cpp.runtime import chunk_bounds
    for n in (1, 100, 512, 513, 1024, 1025, 1100, 1500, 4096, 5000):
        for chunk, edge in ((512, 0), (512, 128), (512, 256), (256, 100)):
            bounds = chunk_bounds(n, chunk, edge)
            assert [b[1] for b in bounds] == chunk_sizes(n, chunk, edge)
            assert [b[0] for b in bounds] == [sum(chunk_sizes(n, chunk, edge)[:i])
                                             for i in range(len(bounds))]
