"""``pymooncake serve --demo`` (``make demo``): what the cluster does, shown on a few requests.

Against a running cluster (``LocalCluster``), through the OpenAI API only:

1. three short questions, streamed: each answer with its TTFT and TBT;
2. two questions about the same long document: the second reuses the document's KV
   (``usage.prompt_tokens_details.cached_tokens`` > 0) — the prefix cache at work;
3. a short replay of the bundled conversation trace (``pymooncake replay``): TTFT,
   TBT, token hit ratio, rejections.

The requests name the model ``/v1/models`` lists (e.g. ``SmolLM2-135M-Instruct``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

QUESTIONS = (
    "What is the capital of France?",
    "Name the three primary colors.",
    "Why is the sky blue? Answer in one sentence.",
)

DOCUMENT = (
    "Mooncake is the serving platform of Kimi, an LLM chatbot. It separates the prefill "
    "and decode stages of inference into different pools of machines. The prefill pool "
    "computes the key-value cache (KV cache) of a prompt; the decode pool generates the "
    "answer token by token. Mooncake treats the KV cache as data: it is stored in a "
    "distributed cache made of the spare CPU memory, DRAM and SSD of the GPU cluster, "
    "named by hashes of token blocks, reused by later requests that share a prefix, and "
    "moved between machines with a Transfer Engine over RDMA. A global scheduler, the "
    "Conductor, sends each request to the prefill instance where the most of its prefix "
    "is already cached and the queue is short, and rejects requests early when the "
    "cluster could not meet the time-to-first-token or time-between-tokens objectives."
)
"""The shared prefix of part 2 (about 200 tokens with SmolLM2's tokenizer)."""

DOC_QUESTIONS = ("Where does Mooncake keep the KV cache?",
                 "What does the Conductor do?")

MAX_TOKENS = 96
"""Enough for a whole short answer from SmolLM2-135M-Instruct."""

REPLAY_LIMIT = 6
REPLAY_LENGTH_SCALE = 32
"""The replay: the trace's first 6 requests (they arrive together), lengths / 32 (a trace
block of 512 tokens is one 16-token KV block, so the shared system-prompt block can hit).
The first 10 requests at / 32 are 6,700 prompt tokens, about 10 s of SmolLM2 prefill on
2 CPU cores: TTFT then measures the queue more than the cluster."""


def _chat(client: Any, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """One streamed greedy chat request: answer, TTFT, mean TBT, usage."""
    t0 = time.monotonic()
    ttft = None
    tokens = 0
    text: list[str] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/chat/completions", json={
            "model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message"))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                piece = ch.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    text.append(piece)
    total = time.monotonic() - t0
    tokens = usage.get("completion_tokens") or len(text)
    return {"question": messages[-1]["content"], "answer": "".join(text).strip(),
            "ttft_s": round(ttft or total, 4),
            "tbt_mean_s": round((total - (ttft or total)) / max(tokens - 1, 1), 4),
            "completion_tokens": tokens, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def run_demo(url: str, as_json: bool) -> int:
    """Parts 1–3 above against ``url``; prints a readable report (or ``--json``)."""
    import httpx

    from pymooncake.cli.common import emit
    from pymooncake.cli.main import CommandError
    from pymooncake.cli.readiness import wait_ready
    health = wait_ready(url, timeout_s=60)
    with httpx.Client(base_url=url, timeout=300) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        try:
            chats = [_chat(client, model, [{"role": "user", "content": q}])
                     for q in QUESTIONS]
            shared = [_chat(client, model, [
                {"role": "system", "content": "Answer from this text.\n\n" + DOCUMENT},
                {"role": "user", "content": q}]) for q in DOC_QUESTIONS]
        except (RuntimeError, httpx.HTTPError) as e:
            raise CommandError(f"demo request failed: {e}") from None
    replay = _demo_replay(url)
    doc = {"url": url, "model": model, "chats": chats, "shared_prefix": shared,
           "replay": replay, "workers": [{k: w[k] for k in ("instance_id", "role", "pid")}
                                         for w in health.get("workers", [])]}
    emit(doc, as_json, _human)
    return 0


def _human(d: dict[str, Any]) -> str:
    def answer(c: dict[str, Any]) -> str:
        lines = [ln for ln in c["answer"].splitlines() if ln.strip()] or ["(empty)"]
        return "A: " + "\n   ".join(lines)

    def timing(c: dict[str, Any]) -> str:
        return (f"   TTFT {c['ttft_s'] * 1e3:.0f} ms · TBT {c['tbt_mean_s'] * 1e3:.1f} ms · "
                f"{c['completion_tokens']} tokens · prompt {c['prompt_tokens']} tokens, "
                f"{c['cached_tokens']} cached")

    out = [f"pymooncake demo: {d['model']} served at {d['url']}",
           "  workers: " + ", ".join(f"{w['instance_id']} (pid {w['pid']})"
                                     for w in d["workers"]), ""]
    if d["model"] == "tiny":
        out[-1:] = ["  (the tiny model's weights are random: its answers are noise; the default "
                    "--model smollm2 answers in words)", ""]
    for c in d["chats"]:
        out += [f"Q: {c['question']}", answer(c), timing(c), ""]
    out.append("Two questions about one document (the second reuses the document's KV "
               "cache):")
    for c in d["shared_prefix"]:
        out += [f"Q: {c['question']}", answer(c), timing(c)]
    out.append("")
    r = d["replay"]
    if "error" in r:
        out.append(f"trace replay: {r['error']}")
    else:
        out.append(f"Trace replay: the first {r['num_requests']} requests of the bundled "
                   f"conversation trace, arriving together (lengths / {REPLAY_LENGTH_SCALE}):")
        out.append(f"   TTFT mean {r['ttft_mean_s'] * 1e3:.0f} ms (P99 "
                   f"{r['ttft_p99_s'] * 1e3:.0f} ms) · TBT mean {r['tbt_mean_s'] * 1e3:.1f} ms"
                   f" · token hit ratio {r['token_hit_ratio']:.2f} · rejected "
                   f"{r['num_rejected']}")
    return "\n".join(out)


def _demo_replay(url: str) -> dict[str, Any]:
    import subprocess
    argv = [sys.executable, "-m", "pymooncake", "replay", "--url", url,
            "--limit", str(REPLAY_LIMIT), "--time-scale", "4",
            "--length-scale", str(REPLAY_LENGTH_SCALE), "--json"]
    try:
        r = subprocess.run(argv, capture_output=True, timeout=120, text=True)
    except subprocess.TimeoutExpired:
        return {"error": "replay did not finish in 120 s"}
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["replay failed"])[-1]}
    doc = json.loads(r.stdout)
    if doc.get("ttft_mean_s") is None:
        return {"error": f"no request of {doc.get('num_requests')} was served"}
    return {k: doc.get(k) for k in ("num_requests", "num_rejected", "ttft_mean_s", "ttft_p99_s",
                                    "tbt_mean_s", "tbt_p99_s", "token_hit_ratio",
                                    "request_hit_ratio")}
