"""The capacity experiment's workload and client (``bench capacity``, issue 15).

* ``select_sample``: which trace requests a point replays. Requests are subsampled, never
  shortened: whole prefix *families* (requests sharing their first two hash ids — one
  conversation, one agent session) are drawn at random (seeded) until the sample has
  ``n`` requests, so the reuse inside a family survives; requests longer than the model's
  context after ``length_scale`` are left out first. Of ``DRAWS`` seeded draws the one whose
  cache ratio is closest to the eligible trace's is kept (a small sample's reuse varies:
  17-39 % for 32 conversation requests against 38 % for the trace).
* ``at_rate``: the sample's recorded arrival times, rebased to 0 and stretched so that the
  mean arrival rate is the target (the paper's "replayed at scaled rates").
* ``replay``: sends each request at its time as a streamed greedy completion of token ids
  (``POST /v1/completions``, ``ignore_eos``, ``return_token_ids``: the same request
  ``pymooncake replay`` sends), round-robin over one or more base URLs (two vLLM servers of
  one core each need no proxy), with a total deadline per request; one record per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from collections.abc import Sequence
from typing import Any

from pymooncake.obs.slo import tbt_from_token_times_s
from pymooncake.workload import Trace, TraceRequest, materialize_trace, scaled_length
from pymooncake.workload.stats import trace_stats

FAMILY_DEPTH = 2
"""Hash ids that name a request's family (the conversation trace's first block is shared
by every request, so one id would make a single family)."""


def _family(r: TraceRequest) -> tuple[int, ...]:
    return tuple(r.hash_ids[:FAMILY_DEPTH]) or (-1 - r.index,)


DRAWS = 16


def _draw(families: dict[tuple[int, ...], list[TraceRequest]], n: int, seed: int
          ) -> list[TraceRequest]:
    keys = list(families)
    random.Random(seed).shuffle(keys)
    chosen: list[TraceRequest] = []
    for k in keys:
        if len(chosen) >= n:
            break
        chosen.extend(families[k])
    return sorted(chosen, key=lambda r: (r.timestamp_ms, r.index))[:n]


def select_sample(trace: Trace, n: int, *, length_scale: int, max_model_len: int,
                  seed: int = 0, draws: int = DRAWS) -> tuple[Trace, dict[str, Any]]:
    """``n`` requests of ``trace`` (whole families, drawn at random; arrival order) and a
    description of the sample beside the eligible trace."""
    if n < 1 or draws < 1:
        raise ValueError(f"need at least one request and one draw, got {n}, {draws}")
    eligible = [r for r in trace.requests
                if scaled_length(r.input_length, length_scale)
                + scaled_length(r.output_length, length_scale) <= max_model_len]
    families: dict[tuple[int, ...], list[TraceRequest]] = {}
    for r in eligible:
        families.setdefault(_family(r), []).append(r)
    full = trace_stats(dataclasses.replace(trace, requests=tuple(eligible)))
    best: tuple[float, int, list[TraceRequest]] | None = None
    for s in range(seed, seed + draws):
        cand = _draw(families, n, s)
        ratio = trace_stats(dataclasses.replace(trace, requests=tuple(cand))).cache_ratio
        if best is None or abs(ratio - full.cache_ratio) < best[0]:
            best = (abs(ratio - full.cache_ratio), s, cand)
    assert best is not None
    _, drawn_seed, chosen = best
    sample = dataclasses.replace(trace, requests=tuple(chosen))
    st = trace_stats(sample)
    info = {"trace_requests": len(trace.requests), "eligible": len(eligible),
            "draw_seed": drawn_seed, "draws": draws,
            "left_out_too_long": len(trace.requests) - len(eligible),
            "families_drawn": len({_family(r) for r in chosen}), "requests": len(chosen),
            "cache_ratio_sample": st.cache_ratio, "cache_ratio_eligible": full.cache_ratio,
            "mean_input_tokens": st.mean_input_length / length_scale,
            "mean_output_tokens": st.mean_output_length / length_scale,
            "max_input_tokens": max(scaled_length(r.input_length, length_scale)
                                    for r in chosen)}
    return sample, info


def at_rate(trace: Trace, rate: float) -> Trace:
    """``trace`` with arrivals rebased to 0 and scaled to a mean rate of ``rate`` req/s
    (``(n - 1)`` intervals over the span); a trace whose arrivals are all equal is spread
    evenly at that rate."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    reqs = trace.requests
    if not reqs:
        return trace
    t0 = reqs[0].timestamp_ms
    span_ms = reqs[-1].timestamp_ms - t0
    if len(reqs) == 1:
        new = [0.0]
    elif span_ms <= 0:
        new = [i * 1e3 / rate for i in range(len(reqs))]
    else:
        factor = (len(reqs) - 1) * 1e3 / rate / span_ms
        new = [(r.timestamp_ms - t0) * factor for r in reqs]
    return dataclasses.replace(trace, requests=tuple(
        dataclasses.replace(r, timestamp_ms=t) for r, t in zip(reqs, new, strict=True)))


def materialize(trace: Trace, *, vocab_size: int, length_scale: int, seed: int,
                reserved_low: int) -> list[Any]:
    """``workload.materialize_trace``: equal hash ids give equal token blocks (under one
    ``seed``; another seed shares nothing with it)."""
    return materialize_trace(trace, vocab_size=vocab_size, scale=length_scale, seed=seed,
                             reserved_low=reserved_low)


async def _one(client: Any, url: str, req: Any, model: str | None, deadline_s: float
               ) -> dict[str, Any]:
    import httpx

    rec: dict[str, Any] = {"index": req.index, "prompt_tokens": len(req.token_ids),
                           "max_tokens": req.max_tokens, "url": url, "status": 0,
                           "cached_tokens": 0, "completion_tokens": 0, "error": None}
    body: dict[str, Any] = {
        "prompt": list(req.token_ids), "max_tokens": req.max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True}
    if model:
        body["model"] = model
    times: list[float] = []
    sent = time.monotonic()

    async def run() -> None:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    err = json.loads(raw)["error"]
                    rec["error"] = str(err.get("code") or err.get("message"))[:200]
                except (ValueError, KeyError, TypeError, AttributeError):
                    rec["error"] = raw[:200].decode(errors="replace")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["status"], rec["error"] = 500, str(chunk["error"])[:200]
                    continue
                for ch in chunk.get("choices", []):
                    times.extend([now] * len(ch.get("token_ids") or []))
                usage = chunk.get("usage")
                if usage:
                    rec["completion_tokens"] = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    rec["cached_tokens"] = details.get("cached_tokens") or 0

    try:
        await asyncio.wait_for(run(), timeout=max(0.001, deadline_s))
    except TimeoutError:
        rec["status"], rec["error"] = 0, f"no complete answer within {deadline_s:.0f} s"
    except httpx.HTTPError as e:
        rec["status"], rec["error"] = 0, f"{type(e).__name__}: {e}"[:200]
    served = rec["status"] == 200 and bool(times)
    if rec["status"] == 200 and not times:
        rec["status"], rec["error"] = 500, rec["error"] or "no token in the stream"
    rec["ttft_s"] = times[0] - sent if served else None
    rec["tbt_s"] = tbt_from_token_times_s(times) if served else None
    rec["tokens"] = len(times)
    return rec


async def _replay(urls: Sequence[str], requests: Sequence[Any], model: str | None,
                  timeout_s: float, sequential: bool) -> list[dict[str, Any]]:
    import httpx

    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if sequential:
            return [await _one(client, urls[i % len(urls)], r, model, timeout_s)
                    for i, r in enumerate(requests)]
        t0 = time.monotonic()
        first = requests[0].timestamp_ms / 1e3 if requests else 0.0

        async def at(i: int, req: Any) -> dict[str, Any]:
            delay = t0 + req.timestamp_ms / 1e3 - first - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = await _one(client, urls[i % len(urls)], req, model, timeout_s)
            rec["arrival_s"] = round(req.timestamp_ms / 1e3 - first, 4)
            return rec

        return list(await asyncio.gather(*(at(i, r) for i, r in enumerate(requests))))


def replay(urls: Sequence[str], requests: Sequence[Any], *, model: str | None = None,
           timeout_s: float = 120.0, sequential: bool = False) -> list[dict[str, Any]]:
    """Replay ``requests`` (``workload.MaterializedRequest``, arrival order) round-robin over
    ``urls`` at their arrival times (or one at a time, ``sequential``); one record per
    request (``capacity.summarize_point``'s fields). A request without its last token
    ``timeout_s`` after it was sent counts as failed (status 0)."""
    if not urls:
        raise ValueError("no URL to replay against")
    return asyncio.run(_replay(list(urls), list(requests), model, timeout_s, sequential))


def compact(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records as stored in the document (times rounded to 0.1 ms, no URL bodies)."""
    def r4(v: Any) -> Any:
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else round(v, 5)
    keep = ("index", "status", "prompt_tokens", "cached_tokens", "max_tokens", "tokens",
            "error")
    return [{k: r.get(k) for k in keep} | {"ttft_s": r4(r.get("ttft_s")),
                                          "tbt_s": r4(r.get("tbt_s")),
                                          "arrival_s": r.get("arrival_s"),
                                          "server": r.get("url", "").rsplit(":", 1)[-1]}
            for r in records]
