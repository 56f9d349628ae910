"""Per-request records (CSV) and the run summary of a simulation.

The summary carries every key of ``pymooncake replay --json`` (the serving issue) so simulated
and live runs compare key for key, plus the simulator's own figures. TTFT/TBT/SLO follow
``pymooncake.obs.slo`` (the paper's definitions, §5.1).
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pymooncake.obs.slo import meets_slo, percentile
from pymooncake.sim.cluster import SimRequest
from pymooncake.sim.runner import SimResult

CSV_FIELDS = ("index", "request_id", "arrival_s", "input_length", "output_length",
              "prefill_node", "decode_node", "rejected", "hit_tokens", "remote_hit_tokens",
              "prefill_start_s", "first_token_s", "kv_arrive_s", "finish_s", "ttft_s", "tbt_s",
              "prefill_gpu_s", "transfer_bytes")


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else math.nan


def _clean(v: float) -> float | None:
    return None if isinstance(v, float) and math.isnan(v) else v


def summarize(res: SimResult) -> dict[str, Any]:
    """The run summary (seconds, tokens, bytes; ratios in [0, 1]; NaN → ``None``)."""
    cfg = res.config
    reqs = res.requests
    served = [r for r in reqs if not r.rejected]
    ttfts = [r.first_token_s - r.arrival_s for r in served]
    tbts = [r.tbt_s for r in served if r.tbt_s is not None]
    ok = sum(meets_slo(r.first_token_s - r.arrival_s, r.tbt_s, cfg.ttft_slo_s, cfg.tbt_slo_s)
             for r in served)
    in_tok = sum(r.input_length for r in served)
    hit_tok = sum(r.hit_tokens for r in served)
    out: dict[str, Any] = {
        "num_requests": len(reqs),
        "num_rejected": len(reqs) - len(served),
        "ttft_mean_s": _mean(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "tbt_mean_s": _mean(tbts),
        "tbt_p50_s": percentile(tbts, 50),
        "tbt_p90_s": percentile(tbts, 90),
        "tbt_p99_s": percentile(tbts, 99),
        "slo_attainment": ok / len(reqs) if reqs else 0.0,
        "request_hit_ratio": _mean([r.hit_tokens / r.input_length for r in served]),
        "token_hit_ratio": hit_tok / in_tok if in_tok else 0.0,
        "prefill_gpu_time_mean_s": _mean([r.prefill_gpu_s for r in served]),
        "effective_request_capacity": ok / len(reqs) if reqs else 0.0,
        "ttft_slo_s": cfg.ttft_slo_s,
        "tbt_slo_s": cfg.tbt_slo_s,
        "rejections": dict(sorted(Counter(r.rejected for r in reqs if r.rejected).items())),
        "bytes_moved": res.bytes_moved,
        "bytes_cache_fetch": res.bytes_cache_fetch,
        "remote_hit_tokens": sum(r.remote_hit_tokens for r in served),
        "hot_key_replicas": res.hot_key_replicas,
        "makespan_s": max((r.finish_s for r in served if not math.isnan(r.finish_s)),
                          default=0.0) - (reqs[0].arrival_s if reqs else 0.0),
        "num_events": res.num_events,
        "scenario": cfg.scenario,
        "scheduler": cfg.scheduler,
        "num_prefill": cfg.num_prefill,
        "num_decode": 0 if cfg.scenario == "colocated" else cfg.num_decode,
        "model": cfg.model,
        "gpu": cfg.gpu,
        "calibration": cfg.calibration,
        "cache_capacity_tokens": res.cache_capacity_tokens,
        "early_rejection": cfg.early_rejection,
        "cpp_groups": cfg.cpp_groups,
    }
    if cfg.cpp_groups:      # CPP prefill groups (docs/cpp.md): their config, who used them
        groups = {f"cpp{i}" for i in range(cfg.cpp_groups)}
        out.update(cpp_stages=cfg.cpp_stages, cpp_chunk_tokens=cfg.cpp_chunk_tokens,
                   cpp_min_tokens=cfg.cpp_min_tokens,
                   num_prefilled_by_cpp=sum(r.prefill_node in groups for r in served))
    return {k: (_clean(v) if isinstance(v, float) else v) for k, v in out.items()}


def write_csv(reqs: Sequence[SimRequest], path: str | Path) -> None:
    """One row per request (``CSV_FIELDS``); times in seconds, NaN left empty."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in reqs:
            ttft = r.first_token_s - r.arrival_s
            row = [r.index, r.request_id, r.arrival_s, r.input_length, r.output_length,
                   r.prefill_node, r.decode_node, r.rejected, r.hit_tokens, r.remote_hit_tokens,
                   r.prefill_start_s, r.first_token_s, r.kv_arrive_s, r.finish_s, ttft,
                   r.tbt_s, r.prefill_gpu_s, r.transfer_bytes]
            w.writerow("" if (v is None or (isinstance(v, float) and math.isnan(v))) else v
                       for v in row)
