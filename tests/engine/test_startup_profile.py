"""The worker's start-up prefill profile (``engine.worker.profile.startup_profile``) and the
colocated worker's ``prefill`` stage window (``StageClock.prompt_stage``)."""

from __future__ import annotations

from types import SimpleNamespace

from pymooncake.engine.hooks import ScheduledSeq, StepContext
from pymooncake.engine.worker.profile import STARTUP_PROFILE_LENGTHS, startup_profile
from pymooncake.engine.worker.stages import StageClock


def test_startup_profile_times_the_lengths_that_fit_and_leaves_the_engine_untouched():
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    eng = Engine.from_model_name("tiny", EngineConfig(max_model_len=1024, num_kv_blocks=64,
                                                      block_size=16))
    free, stats = eng.pool.num_free_blocks, eng.stats()
    samples = startup_profile(eng, 600)
    assert [n for n, _, _ in samples] == [n for n in STARTUP_PROFILE_LENGTHS if n <= 600]
    assert [n for n, _, _ in samples] == [128, 256, 512]
    assert all(p == 0 and s > 0 for _, p, s in samples)
    # its own cache: nothing of the profile is in the engine's (no block taken, no hit)
    assert eng.pool.num_free_blocks == free and eng.stats() == stats
    assert not eng.requests and not eng.has_unfinished()
    # the engine still serves, and the model computes what it did before
    ref = Engine.from_model_name("tiny", EngineConfig(max_model_len=1024)).generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))[0].output_token_ids
    out = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert list(out.output_token_ids) == list(ref)
    # the lengths are capped by max_model_len too; fewer than 3 lengths: no profile
    assert [n for n, _, _ in startup_profile(eng, 10_000)] == [128, 256, 512]
    assert startup_profile(eng, 300) == []


def test_colocated_clock_reports_the_prompt_steps_as_prefill():
    """Steps computing a prompt chunk (more than one new token) extend ``prefill``; every
    step extends ``generate``; a decode-only clock has no ``prefill`` window."""
    times = iter([10.0, 11.0, 12.0, 13.0, 14.0, 15.0])
    import pymooncake.engine.worker.stages as stages
    kv = SimpleNamespace(num_layers=1)

    def step(clock: StageClock, seqs: list[tuple[str, int]]) -> None:
        ctx = StepContext(0, tuple(ScheduledSeq(r, (), 0, n) for r, n in seqs), ())
        clock.start_step(ctx, kv)   # type: ignore[arg-type]
        clock.after_layer(0, ctx, kv)   # type: ignore[arg-type]

    real = stages.time.time
    stages.time.time = lambda: next(times)   # type: ignore[assignment]
    try:
        col = StageClock("generate", "queue", prompt_stage="prefill")
        step(col, [("a", 256)])              # 10 -> 11: a's first chunk
        step(col, [("a", 100), ("b", 1)])    # 12 -> 13: a's last chunk beside b's decode
        step(col, [("a", 1), ("b", 1)])      # 14 -> 15: decodes only
    finally:
        stages.time.time = real
    a, b = dict((w[0], w[1:]) for w in col.pop("a")), dict((w[0], w[1:]) for w in col.pop("b"))
    assert a == {"generate": (10.0, 15.0), "prefill": (10.0, 13.0)}
    assert b == {"generate": (12.0, 15.0)}
    plain = StageClock("decode", "decode_queue")
    step(plain, [("c", 64)])
    assert [w[0] for w in plain.pop("c")] == ["decode"]
