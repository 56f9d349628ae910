"""``pymooncake replay``: live trace replay through the OpenAI API (serving issue).

Each trace request is materialised into token ids with the workload layer (equal hash ids
→ equal token blocks, lengths divided by ``--length-scale``), sent to
``POST /v1/completions`` at its (``--time-scale``d) arrival time as a streamed greedy
request with ``max_tokens`` = its scaled output length and ``ignore_eos``, and timed per
token (the ``return_token_ids`` extension gives one chunk per engine step). The report
uses ``obs.slo`` — the same TTFT/TBT/SLO definitions as the simulator. Per-stage time comes
from the Conductor's ``pymooncake_conductor_stage_seconds`` histogram on ``URL/metrics``,
read before the first request and after the last (a server without it: no stage figures).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import csv
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pymooncake.cli.common import add_json_flag, emit
from pymooncake.cli.main import CommandError, UsageError


@dataclass(slots=True)
class ReplayRecord:
    """One replayed request. Times are seconds on the client's monotonic clock."""

    index: int
    prompt_tokens: int
    max_tokens: int
    sent_s: float = math.nan
    status: int = 0
    """HTTP status; 0 = no response (connection error or client timeout)."""
    error: str | None = None
    code: str | None = None
    """The OpenAI error body's ``code`` (e.g. ``ttft_slo``, ``saturated``) of a refusal."""
    token_times_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def served(self) -> bool:
        return self.status == 200 and bool(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.sent_s if self.served else None

    @property
    def tbt_s(self) -> float | None:
        from pymooncake.obs.slo import tbt_from_token_times_s

        return tbt_from_token_times_s(self.token_times_s) if self.served else None


async def _one(client: Any, url: str, rec: ReplayRecord, prompt: list[int],
               model: str | None) -> None:
    import httpx

    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": rec.max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if model:
        body["model"] = model
    rec.sent_s = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    err = json.loads(raw)["error"]
                    rec.error = err["message"]
                    rec.code = str(err.get("code") or err.get("type") or "") or None
                except (ValueError, KeyError, TypeError, AttributeError):
                    rec.error = raw[:200].decode(errors="replace")
                return
            done = False
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: ") or done:
                    continue
                now = time.monotonic()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    err = chunk["error"]
                    rec.error = err.get("message")
                    rec.code = str(err.get("code") or err.get("type") or "") or None
                    rec.status = 500
                    continue
                for ch in chunk.get("choices", []):
                    rec.token_times_s.extend([now] * len(ch.get("token_ids", [])))
                usage = chunk.get("usage")
                if usage:
                    rec.completion_tokens = usage["completion_tokens"]
                    rec.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
            if not done:        # the server closed the stream without its final event
                rec.status = 0
                rec.error = "IncompleteStream: the stream ended without data: [DONE]"
    except httpx.HTTPError as e:
        rec.status = 0
        rec.error = f"{type(e).__name__}: {e}"


async def replay(url: str, requests: list[Any], *, timeout_s: float = 600.0,
                 model: str | None = None, max_connections: int = 1024) -> list[ReplayRecord]:
    """Send ``requests`` (``workload.MaterializedRequest``) at their arrival times."""
    import httpx

    records = [ReplayRecord(r.index, len(r.token_ids), r.max_tokens) for r in requests]
    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_connections)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic()
        t_first = requests[0].timestamp_ms / 1e3 if requests else 0.0

        async def at(req: Any, rec: ReplayRecord) -> None:
            delay = t0 + (req.timestamp_ms / 1e3 - t_first) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await _one(client, url, rec, list(req.token_ids), model)

        await asyncio.gather(*(at(r, rec) for r, rec in zip(requests, records, strict=True)))
    return records


STAGE_METRIC = "pymooncake_conductor_stage_seconds"
"""The Conductor's per-request-stage histogram (label ``stage``), seconds."""


def parse_stage_seconds(text: str) -> dict[str, tuple[float, float]]:
    """``stage -> (sum_s, count)`` of ``STAGE_METRIC`` in a Prometheus text exposition.

    Parsed with ``prometheus_client.parser``; stages absent from ``text`` are absent from
    the result. Raises ``ValueError`` when ``text`` is not Prometheus text format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name != STAGE_METRIC:
                continue
            for sample in family.samples:
                stage = sample.labels.get("stage")
                if stage is None:
                    continue
                if sample.name == STAGE_METRIC + "_sum":
                    sums[stage] = float(sample.value)
                elif sample.name == STAGE_METRIC + "_count":
                    counts[stage] = float(sample.value)
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise ValueError(f"not Prometheus text format: {e}") from None
    return {k: (sums[k], counts[k]) for k in sums.keys() & counts.keys()}


def stage_means_s(before: dict[str, tuple[float, float]],
                  after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean seconds per stage between two ``parse_stage_seconds`` snapshots.

    Per stage ``(sum_after - sum_before) / (count_after - count_before)``; a stage missing
    from ``before`` counts from zero (the Conductor had not observed it yet); stages with no
    new observations are left out. Sorted by stage name.
    """
    out: dict[str, float] = {}
    for stage in sorted(after):
        sum_s, count = after[stage]
        sum0_s, count0 = before.get(stage, (0.0, 0.0))
        if count - count0 > 0:
            out[stage] = (sum_s - sum0_s) / (count - count0)
    return out


def fetch_stage_seconds(url: str, timeout_s: float = 10.0) -> dict[str, tuple[float, float]] | None:
    """``parse_stage_seconds`` of ``GET url/metrics``; None when it is missing or unparsable
    (a server that is not a pymooncake Conductor)."""
    import httpx

    try:
        resp = httpx.get(f"{url}/metrics", timeout=timeout_s)
        if resp.status_code != 200:
            return None
        return parse_stage_seconds(resp.text)
    except (httpx.HTTPError, ValueError):
        return None


def served_model(url: str, timeout_s: float = 10.0) -> str | None:
    """The first model ``GET url/v1/models`` lists; None when it lists none or cannot be
    read (requests are then sent without ``model``)."""
    import httpx

    try:
        data = httpx.get(f"{url}/v1/models", timeout=timeout_s).json()["data"]
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
        return None


def summarize(records: list[ReplayRecord], ttft_slo_s: float, tbt_slo_s: float,
              wall_s: float) -> dict[str, Any]:
    """The replay report (keys shared with ``pymooncake sim run --json``)."""
    from pymooncake.obs.slo import percentile, slo_attainment

    served = [r for r in records if r.served]
    ttfts = [r.ttft_s for r in served]
    tbts = [t for t in (r.tbt_s for r in served) if t is not None]
    prompt = sum(r.prompt_tokens for r in served)
    cached = sum(r.cached_tokens for r in served)

    def mean(xs: list[float]) -> float | None:
        return math.fsum(xs) / len(xs) if xs else None

    def pct(xs: list[float], q: float) -> float | None:
        return percentile(xs, q) if xs else None

    return {
        "num_requests": len(records),
        "num_served": len(served),
        "num_rejected": sum(r.status in (429, 503) for r in records),
        "num_failed": sum(not r.served and r.status not in (429, 503) for r in records),
        "refusals": dict(sorted(collections.Counter(
            f"{r.status} {r.code or '-'}" for r in records
            if not r.served and r.status in (429, 503)).items())),
        "ttft_mean_s": mean(ttfts), "ttft_p50_s": pct(ttfts, 50), "ttft_p90_s": pct(ttfts, 90),
        "ttft_p99_s": pct(ttfts, 99),
        "tbt_mean_s": mean(tbts), "tbt_p50_s": pct(tbts, 50), "tbt_p99_s": pct(tbts, 99),
        "slo_attainment": slo_attainment([r.ttft_s for r in records],
                                         [r.tbt_s for r in records], ttft_slo_s, tbt_slo_s),
        "ttft_slo_s": ttft_slo_s, "tbt_slo_s": tbt_slo_s,
        "request_hit_ratio": mean([r.cached_tokens / r.prompt_tokens for r in served]) or 0.0,
        "token_hit_ratio": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "completion_tokens": sum(r.completion_tokens for r in served),
        "wall_s": wall_s,
    }


def _human(s: dict[str, Any]) -> str:
    def f(v: Any, unit: str = "") -> str:
        return "-" if v is None else (f"{v:.3f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    return "\n".join([
        f"requests        {s['num_requests']} ({s['num_served']} served, "
        f"{s['num_rejected']} rejected, {s['num_failed']} failed) in {s['wall_s']:.1f} s"
        + ("".join(f"\n  refused        {n} x {k}" for k, n in s.get("refusals", {}).items())),
        f"TTFT            mean {f(s['ttft_mean_s'], ' s')}  p50 {f(s['ttft_p50_s'], ' s')}  "
        f"p99 {f(s['ttft_p99_s'], ' s')}",
        f"TBT             mean {f(s['tbt_mean_s'], ' s')}  p99 {f(s['tbt_p99_s'], ' s')}",
        f"SLO attainment  {100 * s['slo_attainment']:.1f}% (TTFT ≤ {s['ttft_slo_s']:g} s, "
        f"TBT ≤ {s['tbt_slo_s']:g} s)",
        f"hit ratio       {100 * s['token_hit_ratio']:.1f}% token-weighted, "
        f"{100 * s['request_hit_ratio']:.1f}% request-weighted "
        f"({s['cached_tokens']:,} of {s['prompt_tokens']:,} prompt tokens cached)",
        "stages          " + ("  ".join(f"{k} {v:.3f} s" for k, v in
                                        s.get("stage_mean_s", {}).items())
                                 or "- (none: no Conductor stage histogram on /metrics, "
                                    "or no request reached a stage)"),
    ])


def _run(args: argparse.Namespace) -> int:
    from pymooncake.workload import (
        bundled_trace_path,
        load_trace,
        materialize_trace,
        scale_arrivals,
        take_first,
    )
    from pymooncake.workload.trace import TraceError

    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.skip < 0 or (args.limit is not None and args.skip >= args.limit):
        raise UsageError(f"--skip must be >= 0 and below --limit, got {args.skip}")
    if args.time_scale <= 0:
        raise UsageError(f"--time-scale must be > 0, got {args.time_scale}")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not args.wait_ready >= 0:
        raise UsageError(f"--wait-ready must be >= 0 seconds, got {args.wait_ready}")
    if args.vocab_size is not None and args.vocab_size < 2:
        raise UsageError(f"--vocab-size must be >= 2, got {args.vocab_size}")
    if args.length_scale < 1 or 512 % args.length_scale:
        raise UsageError(f"--length-scale must divide the trace block size 512, "
                         f"got {args.length_scale}")
    try:
        trace = load_trace(args.trace or bundled_trace_path())
    except (OSError, TraceError) as e:
        raise CommandError(str(e)) from None
    if args.limit is not None:
        trace = take_first(trace, args.limit)
    trace = scale_arrivals(trace, args.time_scale)
    requests = materialize_trace(trace, vocab_size=args.vocab_size, scale=args.length_scale,
                                 seed=args.seed)
    if args.skip:   # after materializing all: the same tokens as in a whole replay
        if args.skip >= len(requests):
            raise UsageError(f"--skip {args.skip}: the trace has {len(requests)} requests")
        requests = requests[args.skip:]
    url = args.url.rstrip("/")
    from pymooncake.cli.readiness import NotReadyError, wait_ready
    try:   # a cluster that is starting answers 503 on /health until it can serve
        wait_ready(url, args.wait_ready, connect_timeout_s=min(args.timeout, 5.0))
    except NotReadyError as e:
        raise CommandError(str(e)) from None
    model = args.model if args.model is not None else served_model(url)
    stages_before = fetch_stage_seconds(url)
    t0 = time.monotonic()
    records = asyncio.run(replay(url, requests, timeout_s=args.timeout, model=model))
    summary = summarize(records, args.ttft_slo, args.tbt_slo, time.monotonic() - t0)
    stages_after = fetch_stage_seconds(url) if stages_before is not None else None
    summary["stage_mean_s"] = (stage_means_s(stages_before, stages_after)
                               if stages_before is not None and stages_after is not None
                               else {})
    if summary["num_served"] == 0 and records and all(r.status == 0 for r in records):
        raise CommandError(f"no response from {args.url}: {records[0].error}")
    if args.output:
        with open(args.output, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["index", "status", "prompt_tokens", "cached_tokens",
                        "completion_tokens", "ttft_s", "tbt_s", "error"])
            for r in records:
                w.writerow([r.index, r.status, r.prompt_tokens, r.cached_tokens,
                            r.completion_tokens, r.ttft_s, r.tbt_s, r.error or ""])
    emit(summary, args.json, _human)
    failed = [r for r in records if not r.served and r.status not in (429, 503)]
    if failed:
        # the figures above leave them out; say why once, and fail when nothing was served
        sys.stderr.write(f"pymooncake: {len(failed)} of {len(records)} requests failed; "
                         f"first: HTTP {failed[0].status or '-'}: {failed[0].error}\n")
        if summary["num_served"] == 0:
            return 1
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """``pymooncake replay``."""
    p = subparsers.add_parser(
        "replay", help="replay a Mooncake trace against a running OpenAI-compatible server",
        description=__doc__.split("\n\n")[1])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", help="Mooncake JSONL trace (default: the bundled conversation "
                   "trace)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--skip", type=int, default=0, metavar="N",
                   help="leave out the first N of those (a later slice of the trace, timed "
                        "from its own first arrival; default 0)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="speed-up of arrivals (2 = twice as fast)")
    p.add_argument("--length-scale", type=int, default=32,
                   help="divide input/output lengths by this (must divide 512)")
    p.add_argument("--vocab-size", type=int, default=256,
                   help="materialised token ids are < this (default 256: the tiny model's "
                   "byte ids)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="model name to send (default: the first one the server's "
                   "/v1/models lists)")
    p.add_argument("--wait-ready", type=float, default=120.0, metavar="S",
                   help="wait up to S seconds for the server's /health to be 200 (a starting "
                   "pymooncake cluster answers 503 until its workers registered; default "
                   "%(default)s)")
    p.add_argument("--ttft-slo", type=float, default=30.0, help="TTFT objective (s)")
    p.add_argument("--tbt-slo", type=float, default=0.1, help="TBT objective (s)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--output", help="write per-request records to this CSV file")
    add_json_flag(p)
    p.set_defaults(handler=_run)

