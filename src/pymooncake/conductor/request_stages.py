"""The Conductor's request bookkeeping: its Prometheus metrics, stage timings (histogram +
OpenTelemetry span per stage), the policy's predictors from the config, and the mapping of a
refusal or a worker failure to the ``Rejection`` the front door answers with.

Holds ``PLACED`` … ``STAGE_S`` (metrics), ``observe_stages`` (windows a worker measured),
``stage_span`` (a stage the Conductor timed), ``REJECT_STATUS``, ``estimators_from``,
``profile_samples`` and ``worker_failed``. Used by ``conductor.service`` and ``conductor.dispatch``.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from pymooncake.conductor.config import ConductorConfig
from pymooncake.conductor.policy import (
    DecodeEstimator,
    Estimators,
    PrefillEstimator,
    TransferEstimator,
)
from pymooncake.obs import metrics
from pymooncake.obs.tracing import record_span
from pymooncake.rpc import RpcError
from pymooncake.rpc.messages import Rejection, RequestRejected

PLACED = metrics.counter("pymooncake_conductor_placements_total",
                         "requests placed, by prefill instance", ["prefill_instance"])
REJECTED = metrics.counter("pymooncake_conductor_rejections_total",
                           "requests refused by the Conductor, by reason", ["reason"])
FAILED = metrics.counter("pymooncake_conductor_failed_requests_total",
                         "placed requests that failed (worker lost, transfer failed)", ["stage"])
HIT_TOKENS = metrics.counter("pymooncake_conductor_prefix_hit_tokens_total",
                             "prompt tokens the prefill side reused (local cache or Store)")
OVERLAPPED = metrics.counter("pymooncake_conductor_overlapped_admissions_total",
                             "P/D requests whose decode admission ran while their prefill "
                             "queued or computed (KVTarget sent with SetTarget)")
LATE_TARGETS = metrics.counter("pymooncake_conductor_late_targets_total",
                               "overlapped requests whose SetTarget found no prefill waiting "
                               "for it (aborted meanwhile)")
ORPHAN_ABORTS = metrics.counter("pymooncake_conductor_orphan_aborts_total",
                                "requests aborted on their worker because it pushed tokens "
                                "nobody here waits for (client gone, request failed)")
STAGE_S = metrics.histogram("pymooncake_conductor_stage_seconds",
                            "time per request stage (s): the Conductor's own (tokenize, "
                            "schedule, prepare_decode, prefill_rpc, ttft, decode_stream) and "
                            "the windows workers measured (queue, store_lookup, cache_load, "
                            "prefill, p2d_transfer, decode_queue, decode_load, decode, "
                            "generate)", ["stage"])


def observe_stages(request_id: str, windows: Any, parent: Any = None) -> None:
    """Histogram + OpenTelemetry span for each ``(stage, start, end)`` window (unix s) a
    worker measured; malformed windows are skipped (a worker's report is not trusted)."""
    for w in windows or ():
        try:
            name, start, end = str(w[0]), float(w[1]), float(w[2])
        except (TypeError, ValueError, IndexError):
            continue
        if not end >= start:
            continue
        STAGE_S.labels(name).observe(end - start)
        record_span(f"serving.{name}", start, end, parent, request_id=request_id)


def stage_span(request_id: str, name: str, start_s: float, end_s: float, parent: Any = None
           ) -> None:
    """A stage the Conductor timed itself (monotonic ``start_s``/``end_s``)."""
    STAGE_S.labels(name).observe(end_s - start_s)
    wall = time.time() - time.monotonic()
    record_span(f"serving.{name}", start_s + wall, end_s + wall, parent,
                request_id=request_id)


REJECT_STATUS = {"saturated": 429, "ttft_slo": 429, "tbt_slo": 429, "decode_full": 503,
                  "no_instance": 503}


def estimators_from(cfg: ConductorConfig, prefill: PrefillEstimator | None = None
                    ) -> Estimators:
    """The policy's predictors from the config (``prefill`` from a measured profile)."""
    pre = prefill or PrefillEstimator(cfg.prefill_quadratic_s, cfg.prefill_linear_s,
                                      cfg.prefill_overhead_s)
    return Estimators(prefill=pre,
                      transfer=TransferEstimator(cfg.kv_bytes_per_token,
                                                 cfg.transfer_bandwidth_bytes_per_s, 0.001),
                      decode=DecodeEstimator(overhead_s=cfg.decode_step_s * 0.5,
                                             weight_s=cfg.decode_step_s * 0.5,
                                             per_context_token_s=1e-8, per_sequence_s=1e-3))


MAX_PROFILE_SAMPLES = 256
"""A worker's start-up profile holds at most this many samples."""


def profile_samples(raw: str) -> list[tuple[int, int, float]]:
    """``WorkerInfo.prefill_profile_json`` as ``(prompt tokens, reused tokens, seconds)``
    samples (empty for ``""``). Raises ``ValueError`` naming what is wrong: not JSON, not a
    list of ``[int, int, number]``, more than ``MAX_PROFILE_SAMPLES``, or a sample with
    tokens < 1, reused outside ``[0, tokens)`` or seconds not finite and > 0."""
    if not raw:
        return []
    try:
        doc = json.loads(raw)
    except ValueError:
        raise ValueError("prefill_profile_json is not JSON") from None
    if not isinstance(doc, list) or len(doc) > MAX_PROFILE_SAMPLES:
        raise ValueError(f"prefill_profile_json must be a list of at most "
                         f"{MAX_PROFILE_SAMPLES} [tokens, reused, seconds] samples")
    out = []
    for i, s in enumerate(doc):
        ok = (isinstance(s, list) and len(s) == 3
              and all(isinstance(v, int) and not isinstance(v, bool) for v in s[:2])
              and isinstance(s[2], (int, float)) and not isinstance(s[2], bool))
        if not ok or not (s[0] >= 1 and 0 <= s[1] < s[0] and math.isfinite(s[2])
                          and s[2] > 0):
            raise ValueError(f"prefill_profile_json sample {i} is not [tokens >= 1, "
                             f"0 <= reused < tokens, seconds > 0]: {s!r}"[:200])
        out.append((s[0], s[1], float(s[2])))
    return out


def worker_failed(stage: str, err: BaseException) -> RequestRejected:
    """The front door's answer for a request whose worker failed in ``stage``."""
    if isinstance(err, RpcError) and err.code == "INVALID_REQUEST":
        # the worker refused the request itself (e.g. token ids outside its vocabulary)
        return RequestRejected(Rejection(400, "invalid_request", f"{stage}: {err.message}"))
    FAILED.labels(stage).inc()
    return RequestRejected(Rejection(503, "worker_failed",
                                     f"{stage} failed: {err}", retry_after_s=1.0))
