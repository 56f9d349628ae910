"""Layer-wise KV loading through the per-layer hooks: BUG-39 (the wait really waits; a
failed layer load never runs on uninitialised KV) and BUG-10 (a load never writes into a
computed or shared block)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from pymooncake.engine import Engine, EngineConfig, FinishReason, SamplingParams  # noqa: E402
from pymooncake.engine.hooks import NullHooks  # noqa: E402

from .conftest import make_engine, random_prompts  # noqa: E402
from .kv_fakes import FakeExternalTier  # noqa: E402

GREEDY16 = SamplingParams(max_tokens=16, return_logits=True)


def _prefill_blocks(prompt: list[int], **cfg):
    """A prefill-role engine computes the prompt; its full blocks are what gets shipped."""
    prefill = make_engine(role="prefill", **cfg)
    prefill.generate([prompt], SamplingParams(max_tokens=1))
    return prefill.export_blocks(prompt), prefill.kv


def _decode_engine(tier: FakeExternalTier, **cfg) -> Engine:
    return Engine.from_model_name("tiny", EngineConfig(role="decode", **cfg), kv_source=tier)


def test_bug_39_delayed_layer_is_waited_for() -> None:
    (prompt,) = random_prompts(1, 70, 70, seed=39)  # 4 full blocks + 6 tokens
    blocks, kv = _prefill_blocks(prompt)
    (single,) = make_engine().generate([prompt], GREEDY16)

    results = {}
    for delay in (0.0, 0.2):
        tier = FakeExternalTier(blocks, kv, delay_layer=2, delay_s=delay)
        engine = _decode_engine(tier)
        engine.add_request(prompt, GREEDY16, request_id="r")
        engine.step()  # the step that loads the prefix layer by layer
        assert tier.num_loaded_tokens == 64
        start = engine.runner.layer_compute_start_s
        assert len(start) == 4
        assert start[2] >= tier.transfer_done_s[2]  # compute_start(2) >= transfer_done(2)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        (out,) = outs
        assert out.num_cached_tokens == 64
        results[delay] = out
    assert results[0.2].output_token_ids == results[0.0].output_token_ids
    assert results[0.2].output_token_ids == single.output_token_ids
    for warm in results.values():
        diff = (torch.stack(list(warm.logits)) - torch.stack(list(single.logits))).abs().max()
        assert float(diff) <= 1e-4


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_bug_39_failed_layer_load_recomputes_or_fails_cleanly(policy: str) -> None:
    (prompt,) = random_prompts(1, 70, 70, seed=40)
    blocks, kv = _prefill_blocks(prompt)
    (single,) = make_engine().generate([prompt], GREEDY16)
    (other_prompt,) = random_prompts(1, 30, 30, seed=41)
    (other_single,) = make_engine().generate([other_prompt], GREEDY16)
    tier = FakeExternalTier(blocks, kv, fail_layer=2)
    engine = _decode_engine(tier, kv_load_failure=policy)
    outs = engine.generate([prompt, other_prompt], GREEDY16)
    # the request without a load is unaffected either way
    assert outs[1].output_token_ids == other_single.output_token_ids
    if policy == "recompute":
        assert outs[0].output_token_ids == single.output_token_ids
        assert outs[0].finish_reason == FinishReason.LENGTH
    else:
        assert outs[0].finish_reason == FinishReason.ERROR
        assert outs[0].output_token_ids == ()
    engine.kv_manager.check_integrity()
    assert engine.pool.num_free_blocks == engine.config.num_kv_blocks


def test_bug_10_load_never_overwrites_resident_shared_blocks() -> None:
    cfg = dict(block_size=4, num_kv_blocks=64)
    rng = torch.Generator().manual_seed(10)
    a = [256] + torch.randint(0, 256, (19,), generator=rng).tolist()  # 20 tokens
    # external tier: A's blocks as saved in chunks of C=8 tokens with the partial tail
    # [16, 20) saved too (B=4: chunks [0,8), [8,16) = 2 blocks each, the tail = 1 block)
    ext_blocks, kv = _prefill_blocks(a + [7], **cfg)
    assert len(ext_blocks) == 5
    tier = FakeExternalTier(ext_blocks, kv)
    engine = _decode_engine(tier, **cfg)
    other = a[:16] + [1, 2, 3]  # R_other shares A's first 16 tokens and keeps decoding
    other_params = SamplingParams(max_tokens=24)
    (other_solo,) = make_engine(**cfg).generate([other], other_params)
    engine.add_request(other, other_params, request_id="other")
    # R_other loads [0,16) itself from the tier, then decodes a few steps
    for _ in range(3):
        engine.step()
    local = engine.kv_manager.get_blocks(engine.requests["other"])[:4]
    assert all(b.is_computed for b in local)
    before = [engine.kv.block_checksum(b.block_id) for b in local]
    written_before = len(tier.written_block_ids)
    r = a + [9, 8, 7, 6]
    (r_cold,) = make_engine(**cfg).generate([r], GREEDY16)
    engine.add_request(r, GREEDY16, request_id="r")
    outs = {}
    engine.step()
    assert [b.ref_cnt for b in local] == [2, 2, 2, 2]  # shared by R_other and R
    new_writes = tier.written_block_ids[written_before:]
    assert len(new_writes) == 1  # only tokens [16, 20) were loaded
    assert not set(new_writes) & {b.block_id for b in local}
    assert [engine.kv.block_checksum(b.block_id) for b in local] == before
    while engine.has_unfinished():
        outs |= {o.request_id: o for o in engine.step()}
    assert outs["r"].num_cached_tokens == 20
    assert outs["r"].output_token_ids == r_cold.output_token_ids
    assert outs["other"].output_token_ids == other_solo.output_token_ids


class _Recorder(NullHooks):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.new_kv: dict[int, torch.Tensor] = {}

    def before_layer(self, layer, ctx, kv) -> None:
        self.calls.append(("before", layer))

    def after_layer(self, layer, ctx, kv) -> None:
        self.calls.append(("after", layer))
        seq = ctx.seqs[0]
        full = [seq.block_ids[i] for i in range(seq.num_new_tokens // kv.block_size)]
        self.new_kv[layer] = kv.export_layer(layer, full)


def test_after_layer_hook_sees_each_layers_new_kv() -> None:
    rec = _Recorder()
    engine = Engine.from_model_name("tiny", EngineConfig(), hooks=[rec])
    (prompt,) = random_prompts(1, 48, 48, seed=12)
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    engine.step()
    assert rec.calls == [(k, i) for i in range(4) for k in ("before", "after")]
    # what after_layer(i) exported equals the finished cache of layer i
    ids = engine.export_blocks(prompt)
    assert len(ids) == 3
    whole = torch.stack([rec.new_kv[i] for i in range(4)])  # [L, 2, H, 3, bs, D]
    ref = torch.cat([torch.frombuffer(bytearray(b.data), dtype=torch.float32)
                     .view(4, 2, 2, 1, 16, 32) for b in ids], dim=3)
    assert torch.equal(whole, ref)


class _PendingTier(FakeExternalTier):
    """An external tier whose lookup is in flight until ``ready`` is set: it answers None
    (issue 16: the request waits for its remote KV while the engine steps the others)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.ready = threading.Event()
        self.asked = 0

    def get_num_matched_tokens(self, req, num_local_computed_tokens: int) -> int | None:
        n = super().get_num_matched_tokens(req, num_local_computed_tokens)
        if n == 0:
            return 0  # nothing to load: answered at once
        self.asked += 1
        return n if self.ready.is_set() else None


def test_request_waiting_for_its_external_kv_is_skipped_while_others_run() -> None:
    from pymooncake.engine.request import RequestStatus
    (prompt,) = random_prompts(1, 70, 70, seed=16)  # 4 full blocks loadable + 6 tokens
    (other,) = random_prompts(1, 30, 30, seed=17)
    blocks, kv = _prefill_blocks(prompt)
    single = make_engine().generate([prompt, other], GREEDY16)
    tier = _PendingTier(blocks, kv)
    engine = _decode_engine(tier)
    engine.add_request(prompt, GREEDY16, request_id="loading")  # first in FCFS order
    engine.add_request(other, GREEDY16, request_id="other")
    for _ in range(3):  # "other" is admitted and decodes; "loading" keeps waiting
        engine.step()
    req = engine.requests["loading"]
    assert req.status == RequestStatus.WAITING and req.num_computed_tokens == 0
    assert [r.request_id for r in engine.scheduler.running] == ["other"]
    assert len(engine.requests["other"].output_token_ids) == 3
    assert tier.asked == 3 and tier.num_loaded_tokens == 0
    queried = engine.kv_manager.num_queried_blocks
    tier.ready.set()
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert tier.num_loaded_tokens == 64 and outs["loading"].num_cached_tokens == 64
    # a skipped admission is not counted as a prefix-cache query (asked again each step)
    assert engine.kv_manager.num_queried_blocks == queried + len(prompt) // 16
    assert outs["loading"].output_token_ids == single[0].output_token_ids
    assert outs["other"].output_token_ids == single[1].output_token_ids


class _FixedSource(NullHooks):
    """An external source that claims ``n`` tokens after the local prefix (no loading:
    the tests below only schedule)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_num_matched_tokens(self, req, num_local_computed_tokens: int) -> int:
        return self.n


@pytest.mark.parametrize("num_tokens, matched, loaded", [
    (301, 300, 300),    # every prompt token, the partial last block included (P→D)
    (301, 256, 256),    # whole blocks: the 44-token tail is computed with the last token
    (301, 384, 256),    # whole blocks past the end: the full-hit rule keeps whole blocks
    (384, 383, 383),    # the last token fills the partial block: it has a key, not loaded
])
def test_external_match_ends_inside_a_block_only_at_the_last_token(
        num_tokens: int, matched: int, loaded: int) -> None:
    """Prompt + first token = ``num_tokens`` at block size 128 on a decode engine: a match
    of all the prompt's tokens computes 1 token and loads 3 blocks, the partial one
    without a key (only full blocks are keyed, and the token that fills it is not
    loaded); whole-block matches keep their rules (BUG-09). Once the step ran, the full
    blocks are cached."""
    engine = make_engine(role="decode", block_size=128, num_kv_blocks=16)
    engine.scheduler.kv_source = _FixedSource(matched)
    engine.add_request([i % 256 for i in range(num_tokens)], SamplingParams(max_tokens=4),
                       "r")
    out = engine.scheduler.schedule()
    (s,) = out.scheduled
    req = s.request
    assert s.num_new_tokens == num_tokens - loaded and req.num_computed_tokens == loaded
    (ld,) = out.loads
    assert (ld.first_token, ld.num_tokens) == (0, loaded)
    assert len(ld.block_ids) == -(-loaded // 128) and len(ld.block_keys) == loaded // 128
    assert list(ld.block_keys) == req.block_keys[:loaded // 128]
    assert len(engine.kv_manager.get_blocks(req)) == 3
    engine.scheduler.update_from_output(out, {})     # the step ran (nothing sampled)
    assert engine.pool.num_cached_blocks == num_tokens // 128


def test_external_match_inside_a_block_short_of_the_last_token_is_refused() -> None:
    engine = make_engine(role="decode", block_size=128, num_kv_blocks=16)
    engine.scheduler.kv_source = _FixedSource(200)
    engine.add_request([i % 256 for i in range(301)], SamplingParams(max_tokens=4), "r")
    with pytest.raises(AssertionError, match="whole blocks or reach the last token"):
        engine.scheduler.schedule()
