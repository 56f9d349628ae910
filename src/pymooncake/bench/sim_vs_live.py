"""The calibrated simulator beside the live capacity experiment (issue 15, build item 5).

``simulate_like_live`` replays what ``pymooncake bench capacity`` replayed — the same
requests (``capacity_client.select_sample`` with the live run's seed and size), the same
length scale, the same rates (``capacity_client.at_rate``), the same admission objectives —
on a simulated cluster whose costs come from a CPU calibration (``sim.calibration``), and
writes a document of the live format (``bench.capacity.DOC_KIND``, marked ``simulated``) so
``bench.capacity.analyze`` computes its capacities the same way. ``compare`` sets the p90
TTFT of every (trace, system, rate) beside the live one; ``scale_out`` runs the same kind of
sweep at a size this machine cannot host (8P+8D against 16 vLLM-like colocated instances).

How the live systems map onto the simulator (one node = one pinned core):
- ``ours-pd``: ``pd-global``, 1 prefill + 1 decode node, Algorithm 1 (``global-cache``),
  early rejection at the live admission objectives, prefix cache = paged KV + Store segment;
- ``ours-colocated``: ``colocated``, one node per core, ``local-cache`` placement, early
  rejection, chunked prefill interleaved with decode steps, prefix cache in the paged KV;
- ``vllm-2x1``: ``colocated``, one node per core behind round-robin, no rejection — with OUR
  engine's calibrated costs (the calibration measures our engine, not vLLM);
- ``ours-1w``: ``colocated``, ONE node for all the cores with the costs of a calibration
  timed with that many threads (``calibrate-cpu --threads``), stepped like the engine
  (``sim.engine_node``; each step costs the calibration's ``step`` when it has one,
  ``calibrate-cpu --mixed-chunks``): 512-token steps, 256 while any request decodes, shortest-first
  admission (its variants ``ours-1w-c<N>-t<MS>-srpt`` with their cap, step time and
  order: ``capacity_systems.ours_1w_options``), the prefix cache in the whole paged KV
  (every engine's KV together), early rejection at the live objectives with the live
  Conductor's view of a shortest-first queue; its prefill predictor is the calibrated cost
  (the live Conductor fits the worker's start-up profile at registration and refits from
  finished prefills: ``engine.worker.profile``, ``Conductor.learn_profile``), or, for a live
  run made before that (commit 4760ab6), ``conductor_prefill="defaults"``: the
  ``ConductorConfig`` defaults that Conductor predicted with for ever.
Each system takes the calibration whose ``node.threads`` is the threads of its engines (1,
or the cores for ``ours-1w``); a system without one is left out (``config.not_simulated``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from pymooncake.bench import capacity as cap
from pymooncake.bench.capacity_client import at_rate, select_sample
from pymooncake.bench.capacity_systems import ours_1w_options
from pymooncake.conductor.config import ConductorConfig
from pymooncake.sim.calibration import CalibratedCostModel, Calibration
from pymooncake.sim.config import SimConfig
from pymooncake.sim.report import summarize
from pymooncake.sim.runner import simulate
from pymooncake.workload.materialize import scaled_length
from pymooncake.workload.trace import Trace

SIM_SYSTEMS = ("ours-colocated", "ours-pd", "vllm-2x1", "ours-1w")
CONDUCTOR_PREFILL = ("calibrated", "defaults")
"""What the simulated Conductor of ``ours-1w`` predicts a prefill with: the calibrated cost
(live since 4760ab6: the start-up profile) or ``ConductorConfig``'s defaults (earlier runs)."""
_CC = ConductorConfig()
DEFAULT_CONDUCTOR_PREFILL = (_CC.prefill_quadratic_s, _CC.prefill_linear_s,
                             _CC.prefill_overhead_s)
STORE_SEGMENT_CACHES = 2
"""A prefill worker's Store segment holds this many paged caches (engine.config)."""
SOLO_SPACING_MS = 1e7
"""Solo requests are this far apart in the simulation: each runs alone."""
Say = Callable[[str], None]


def scale_lengths(trace: Trace, length_scale: int) -> Trace:
    """The trace as the live harness serves it: prompt and output lengths divided by
    ``length_scale`` (rounded up), blocks of ``block_size // length_scale`` tokens, the same
    hash ids (``workload.materialize``'s scaling)."""
    if length_scale < 1 or trace.block_size % length_scale:
        raise ValueError(f"length scale {length_scale} must divide the block size "
                         f"{trace.block_size}")
    reqs = tuple(dataclasses.replace(
        r, input_length=scaled_length(r.input_length, length_scale),
        output_length=scaled_length(r.output_length, length_scale)) for r in trace.requests)
    return dataclasses.replace(trace, requests=reqs,
                               block_size=trace.block_size // length_scale)


def system_config(system: str, *, cores: int, block_size: int, chunk_tokens: int,
                  kv_tokens: int, admission: tuple[float, float] | None,
                  max_batch_size: int = 64, num_prefill: int | None = None,
                  num_decode: int | None = None,
                  conductor_prefill: str = "calibrated") -> SimConfig:
    """The ``SimConfig`` standing for one live system (see the module docstring);
    ``conductor_prefill`` one of ``CONDUCTOR_PREFILL``.

    Raises:
        ValueError: an unknown system or ``conductor_prefill``."""
    if conductor_prefill not in CONDUCTOR_PREFILL:
        raise ValueError(f"conductor_prefill must be one of {', '.join(CONDUCTOR_PREFILL)}, "
                         f"got {conductor_prefill!r}")
    common = dict(block_size=block_size, chunk_size_tokens=chunk_tokens,
                  max_batch_size=max_batch_size, sample_interval_s=0.0)
    slo = dict(early_rejection=True, ttft_slo_s=admission[0], tbt_slo_s=admission[1]) \
        if admission else dict(early_rejection=False, ttft_slo_s=1e9, tbt_slo_s=1e9)
    if system == "ours-pd":
        return SimConfig(scenario="pd-global", scheduler="global-cache",
                         num_prefill=num_prefill or 1, num_decode=num_decode or 1,
                         cache_capacity_tokens=kv_tokens * (1 + STORE_SEGMENT_CACHES),
                         **common, **slo)
    if (o := ours_1w_options(system)) is not None:   # one engine on every core
        return SimConfig(scenario="colocated", scheduler="local-cache", num_prefill=1,
                         step_budget_tokens=chunk_tokens,
                         decode_step_tokens=o.decode_step_tokens, decode_step_s=o.decode_step_s,
                         prefill_hold_s=o.prefill_hold_s,
                         waiting_order=o.prefill_order or "shortest",
                         aging_tokens_per_s=float(2000.0 if o.aging_tokens_per_s is None
                                                  else o.aging_tokens_per_s),
                         policy_prefill=(DEFAULT_CONDUCTOR_PREFILL
                                         if conductor_prefill == "defaults" else None),
                         **common, **slo)
    if system == "ours-colocated":
        return SimConfig(scenario="colocated", scheduler="local-cache",
                         num_prefill=num_prefill or cores, **common, **slo)
    if system.startswith("vllm"):
        return SimConfig(scenario="colocated", scheduler="round-robin",
                         num_prefill=num_prefill or cores, **common,
                         **dict(early_rejection=False, ttft_slo_s=1e9, tbt_slo_s=1e9))
    raise ValueError(f"no simulated counterpart for system {system!r}; "
                     f"known: {', '.join(SIM_SYSTEMS)}")


def point_summary(trace: Trace, cfg: SimConfig, cm: CalibratedCostModel) -> dict[str, Any]:
    """One simulated point, summarised with the live summary's keys."""
    s = summarize(simulate(trace, cfg, cm))
    n = s["num_requests"]
    out = {k: s[k] for k in ("num_requests", "num_rejected", "ttft_p50_s", "ttft_p90_s",
                             "ttft_p99_s", "tbt_p50_s", "tbt_p90_s", "tbt_p99_s",
                             "token_hit_ratio")}
    out |= {"num_served": n - s["num_rejected"], "num_failed": 0,
            "bad_fraction": s["num_rejected"] / n if n else 1.0}
    return out


def _solo(trace: Trace, k: int) -> Trace:
    reqs = trace.requests[:k]
    return dataclasses.replace(trace, requests=tuple(
        dataclasses.replace(r, timestamp_ms=i * SOLO_SPACING_MS) for i, r in enumerate(reqs)))


def _calibration_info(cal: Calibration, path: str) -> dict[str, Any]:
    return {"path": path, "label": cal.label, "fit": cal.fit,
            "provenance": {k: cal.provenance.get(k) for k in
                           ("machine", "cpu", "commit", "created_utc", "load_average")}}


def sweep_doc(samples: dict[str, Trace], systems: dict[str, SimConfig],
              cm: CalibratedCostModel | dict[str, CalibratedCostModel], *,
              rates: Sequence[float], multiples: Sequence[float],
              solo_requests: int, admission_multiple: float | None = None,
              admission_by_trace: dict[str, Any] | None = None,
              say: Say | None = None) -> dict[str, Any]:
    """A capacity document (live format, ``simulated``) of ``systems`` over ``rates`` for
    each (length-scaled) sample. The systems that reject early get the objectives of
    ``admission_by_trace[trace]`` (the live run's) or else ``admission_multiple`` x the
    simulated solo base (as the live harness does). ``cm``: one cost model for all, or one
    per system."""
    cms = cm if isinstance(cm, dict) else dict.fromkeys(systems, cm)
    doc: dict[str, Any] = {
        "kind": cap.DOC_KIND, "version": cap.DOC_VERSION, "simulated": True,
        "config": {"traces": list(samples), "systems": list(systems), "rates": list(rates),
                   "multiples": list(multiples), "repeats": 1, "admission_slo_s": {}},
        "solo": {t: {} for t in samples}, "points": []}
    for label, sample in samples.items():
        for name, cfg in systems.items():
            loose = dataclasses.replace(cfg, early_rejection=False)
            doc["solo"][label][name] = point_summary(_solo(sample, solo_requests), loose,
                                                     cms[name])
        base = cap.solo_base(doc["solo"][label])
        slo = tuple((admission_by_trace or {}).get(label) or ()) or (
            (admission_multiple * base["ttft_p90_s"], admission_multiple * base["tbt_p90_s"])
            if admission_multiple else None)
        doc["config"]["admission_slo_s"][label] = list(slo) if slo else None
        for name, cfg in systems.items():
            if slo and cfg.early_rejection:
                cfg = dataclasses.replace(cfg, ttft_slo_s=slo[0], tbt_slo_s=slo[1])
            for rate in rates:
                s = point_summary(at_rate(sample, rate), cfg, cms[name])
                doc["points"].append({"trace": label, "system": name, "rate": float(rate),
                                      "repeat": 0, "summary": s})
                if say:
                    say(f"sim {label} {name} rate {rate:g}: p90 TTFT {s['ttft_p90_s']} s, "
                        f"p90 TBT {s['tbt_p90_s']} s, rejected {s['num_rejected']}")
    return doc


def threads_of(system: str, cores: int) -> int:
    """Torch threads of one engine of the live ``system`` (``ours-1w``: one per core)."""
    return cores if ours_1w_options(system) is not None else 1


def pick_calibration(cals: Sequence[tuple[Calibration, str]], threads: int
                     ) -> tuple[Calibration, str] | None:
    """The first calibration timed with ``threads`` threads (``node.threads``, 1 when the
    file does not say)."""
    return next((c for c in cals if int(c[0].node.get("threads", 1)) == threads), None)


def simulate_like_live(live: dict[str, Any], cal: Calibration, calibration_path: str, *,
                       trace_paths: dict[str, str] | None = None, say: Say | None = None,
                       more: Sequence[tuple[Calibration, str]] = (),
                       conductor_prefill: str = "calibrated") -> dict[str, Any]:
    """The live capacity experiment ``live`` replayed in the calibrated simulator; each
    system with the calibration (``cal`` or one of ``more``) of its engines' threads and
    ``conductor_prefill`` (``CONDUCTOR_PREFILL``) as its Conductor's prefill predictor."""
    from pymooncake.workload import load_trace
    c = live["config"]
    if live.get("kind") != cap.DOC_KIND:
        raise ValueError(f"not a `bench capacity` document (kind {live.get('kind')!r})")
    scale, cores = int(c["length_scale"]), len(c.get("cores") or [0, 1])
    kv_tokens = int(c.get("ours_kv_blocks") or 0) * int(c["block_size"]) \
        or cal.kv_capacity_tokens
    cals = [(cal, calibration_path), *more]
    cms: dict[str, CalibratedCostModel] = {}
    used: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for system in c["systems"]:
        got = pick_calibration(cals, threads_of(system, cores))
        known = system in SIM_SYSTEMS or ours_1w_options(system) is not None
        if not known or got is None:
            skipped[system] = ("no simulated counterpart" if not known else
                               f"no {threads_of(system, cores)}-thread calibration given")
            continue
        kv = kv_tokens * threads_of(system, cores)
        cms[system] = CalibratedCostModel(
            dataclasses.replace(got[0], kv_capacity_tokens=kv),
            chunk_size_tokens=int(got[0].node.get("prefill_chunk_tokens", 512)))
        used[system] = got[1]
    if say:
        for system, why in skipped.items():
            say(f"not simulated: {system} ({why})")
    samples = {}
    for label in c["traces"]:
        info = live["traces"][label]
        path = (trace_paths or {}).get(label) or info["path"]
        # The draw the live run kept (``draw_seed``; older documents: one draw of ``seed``).
        sample, got = select_sample(load_trace(path), int(c["requests"]), length_scale=scale,
                                    max_model_len=int(c["max_model_len"]),
                                    seed=int(info.get("draw_seed", c["seed"])), draws=1)
        for k in ("requests", "mean_input_tokens", "mean_output_tokens"):
            if k in info and not math.isclose(got[k], info[k], rel_tol=1e-9):
                raise ValueError(f"{label}: the live run's sample cannot be rebuilt from "
                                 f"{path} ({k} {got[k]:g} here, {info[k]:g} live); pass the "
                                 "trace file the live run used")
        samples[label] = scale_lengths(sample, scale)
    bs = next(iter(samples.values())).block_size
    cfgs = {s: system_config(s, cores=cores, block_size=bs, chunk_tokens=m.chunk_size_tokens,
                             kv_tokens=m.kv_capacity_tokens, admission=(1e9, 1e9),
                             conductor_prefill=conductor_prefill)
            for s, m in cms.items()}
    doc = sweep_doc(samples, cfgs, cms, rates=c["rates"], multiples=c["multiples"],
                    solo_requests=int(c["solo_requests"]),
                    admission_multiple=c.get("admission_multiple"),
                    admission_by_trace=c.get("admission_slo_s"), say=say)
    doc["config"] |= {"length_scale": scale, "requests": c["requests"], "seed": c["seed"],
                      "cores": cores, "kv_tokens_per_node": kv_tokens,
                      "not_simulated": skipped, "conductor_prefill": conductor_prefill}
    doc["calibration"] = _calibration_info(cal, calibration_path)
    doc["calibration_of_system"] = used
    doc["calibrations"] = {p: _calibration_info(k, p) for k, p in cals if p in used.values()}
    return doc


def compare(live: dict[str, Any], sim: dict[str, Any], tolerance: float = 0.20
            ) -> list[dict[str, Any]]:
    """Per (trace, system, rate): live median p90 TTFT (over repeats), simulated p90 TTFT,
    the relative error, and whether the live point is below saturation (every repeat with
    ≤ 10 % rejected or failed and its median p90 TTFT within the loosest threshold)."""
    rows = []
    for label in sim["config"]["traces"]:
        base = cap.solo_base(live["solo"][label]) if live.get("solo", {}).get(label) else None
        loosest = max(live["config"]["multiples"]) * base["ttft_p90_s"] if base else math.inf
        for system in sim["config"]["systems"]:
            lv = {r["rate"]: r for r in cap.rate_curves(live, label, system, "ttft_p90_s")}
            sv = {r["rate"]: r for r in cap.rate_curves(sim, label, system, "ttft_p90_s")}
            for rate in sorted(set(lv) & set(sv)):
                lr, sr = lv[rate], sv[rate]
                lm, sm = lr.get("median"), sr.get("median")
                err = sm / lm - 1 if lm and sm is not None else None
                below = bool(lr["admitted_ok"] and lm is not None and lm <= loosest)
                rows.append({"trace": label, "system": system, "rate": rate,
                             "live_ttft_p90_s": lm, "live_min_s": lr.get("min"),
                             "live_max_s": lr.get("max"), "sim_ttft_p90_s": sm,
                             "rel_error": err, "below_saturation": below,
                             "within_tolerance": err is not None and abs(err) <= tolerance})
    return rows


def scale_out(cal: Calibration, calibration_path: str, trace_paths: dict[str, str], *,
              rates: Sequence[float], requests: int, length_scale: int = 4,
              max_model_len: int = 8192, prefill: int = 8, decode: int = 8,
              colocated: int = 16, multiples: Sequence[float] = (2.0, 5.0, 10.0),
              admission_multiple: float = 5.0, solo_requests: int = 8, seed: int = 0,
              kv_gib: float = 2.0, say: Say | None = None) -> dict[str, Any]:
    """Mooncake P/D (``prefill`` + ``decode`` one-core nodes, global cache, Algorithm 1,
    early rejection) against ``colocated`` vLLM-like one-core instances (chunked prefill
    mixed with decode, local prefix cache, round-robin), all with the calibrated costs.
    Every node has ``kv_gib`` of paged KV (the live harness's ``--kv-gib``)."""
    from pymooncake.workload import load_trace
    kv = int(kv_gib * (1 << 30) // cal.model.kv_bytes_per_token)
    cm = CalibratedCostModel(dataclasses.replace(cal, kv_capacity_tokens=kv),
                             chunk_size_tokens=int(cal.node.get("prefill_chunk_tokens", 512)))
    samples = {}
    for label, path in trace_paths.items():
        sample, _ = select_sample(load_trace(path), requests, length_scale=length_scale,
                                  max_model_len=max_model_len, seed=seed)
        samples[label] = scale_lengths(sample, length_scale)
    bs = next(iter(samples.values())).block_size
    pd_name, co_name = f"mooncake-{prefill}P{decode}D", f"vllm-like-{colocated}x1"
    systems = {
        pd_name: system_config("ours-pd", cores=1, block_size=bs, num_prefill=prefill,
                               num_decode=decode, chunk_tokens=cm.chunk_size_tokens,
                               kv_tokens=kv, admission=(1e9, 1e9)),
        co_name: system_config("vllm", cores=colocated, block_size=bs,
                               chunk_tokens=cm.chunk_size_tokens, kv_tokens=kv,
                               admission=None)}
    doc = sweep_doc(samples, systems, cm, rates=rates, multiples=multiples,
                    solo_requests=solo_requests, admission_multiple=admission_multiple,
                    say=say)
    doc["config"] |= {"length_scale": length_scale, "requests": requests, "seed": seed,
                      "kv_tokens_per_node": kv, "kv_gib": kv_gib, "prefill": prefill,
                      "decode": decode, "colocated": colocated,
                      "admission_multiple": admission_multiple}
    doc["calibration"] = _calibration_info(cal, calibration_path)
    return doc
