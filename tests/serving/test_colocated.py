"""The colocated baseline (``pymooncake serve --colocated``): workers prefill and decode
together; same greedy output as the engine alone; the local prefix cache reports its hits."""

from __future__ import annotations

import random

import pytest

from tests.serving.conftest import complete, stream_token_ids


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(num_prefill=1, colocated=True, num_decode=0, max_model_len=2048,
                        num_kv_blocks=512)


def test_colocated_greedy_output_and_prefix_hits(cluster):
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    rng = random.Random(5)
    prompt = [rng.randrange(256) for _ in range(70)]
    ref = Engine.from_model_name("tiny", EngineConfig(max_model_len=2048)).generate(
        [prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    ids, usage, errors = stream_token_ids(cluster.url, prompt, 10, ignore_eos=True)
    assert not errors
    assert ids == list(ref.output_token_ids)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    r = complete(cluster.url, prompt, 3)
    assert r.status_code == 200, r.text
    # 70 tokens = 4 full blocks of 16 cached by the first request
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
