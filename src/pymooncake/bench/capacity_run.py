"""``bench capacity``'s run: the single-request base, then the sweep (issue 15 item 3).

1. **Solo**: each system is started once (loose admission objectives) and serves the first
   ``solo_requests`` requests of every trace's sample one at a time; the lowest p90 TTFT and
   p90 TBT over the systems is the single-request base the thresholds are multiples of.
2. **Sweep**: for every trace, repeat and system — systems rotated by one each repeat, so a
   slow spell of the machine does not always land on the same one — a fresh start of the
   system (ours with early rejection at ``admission_multiple`` x the base), a warm-up, then
   the sample replayed at every rate, lowest first, each rate under its own token seed (the
   same seed for every system and repeat; no rate can hit blocks cached by another). After
   ``stop_after`` consecutive rates that fail even the loosest pair the higher rates are
   recorded as skipped (saturated).

The document (``capacity.DOC_KIND``) is rewritten after every point, so a run that stops
keeps what it measured. Per point it stores every request's status, TTFT and TBT.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pymooncake.bench import capacity as cap
from pymooncake.bench import capacity_client as client
from pymooncake.bench import capacity_systems as systems

DEFAULT_TRACES_DIR = "/work/shared/traces"


@dataclass
class RunOptions:
    model: str = "smollm2"
    traces: list[str] = field(default_factory=lambda: ["conversation", "synthetic"])
    traces_dir: str = DEFAULT_TRACES_DIR
    systems: list[str] = field(default_factory=lambda: list(systems.SYSTEMS))
    rates: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0])
    repeats: int = 2
    requests: int = 32
    solo_requests: int = 8
    multiples: list[float] = field(default_factory=lambda: [2.0, 5.0, 10.0])
    admission_multiple: float = 5.0
    length_scale: int = 4
    block_size: int = 128
    max_model_len: int = 8192
    kv_gib: int = 2
    cores: list[int] = field(default_factory=lambda: sorted(os.sched_getaffinity(0))[:2])
    vllm_python: str = ".venv-vllm/bin/python"
    vllm_threads: int = 2
    request_timeout_s: float = 180.0
    settle_s: float = 3.0
    stop_after: int = 2
    seed: int = 0
    reserved_low: int = 256
    out: str = "capacity.json"
    workdir: str | None = None


def check_options(o: RunOptions) -> None:
    """``ValueError`` naming the first bad option."""
    for name in o.systems:
        systems.check_system(name)
    if not o.systems or len(set(o.systems)) != len(o.systems):
        raise ValueError("--systems: give each system once")
    if not o.rates or any(not (r > 0 and math.isfinite(r)) for r in o.rates):
        raise ValueError("--rates: give finite rates > 0 req/s")
    if o.repeats < 1 or o.requests < 1 or o.solo_requests < 1 or o.stop_after < 1:
        raise ValueError("--repeats, --requests, --solo-requests, --stop-after must be >= 1")
    if not o.multiples or any(not m > 0 for m in o.multiples) or not o.admission_multiple > 0:
        raise ValueError("--multiples and --admission-multiple must be > 0")
    if o.length_scale < 1 or 512 % o.length_scale:
        raise ValueError(f"--length-scale must divide 512, got {o.length_scale}")
    if o.block_size % 32 or o.block_size < 32:
        raise ValueError("--block-size must be a multiple of 32 (vLLM-CPU)")
    if isinstance(o.kv_gib, bool) or not isinstance(o.kv_gib, int) or o.kv_gib < 1:
        raise ValueError(f"--kv-gib must be a whole number of GiB >= 1 (vLLM's "
                         f"VLLM_CPU_KVCACHE_SPACE takes whole GiB), got {o.kv_gib}")
    if not o.cores:
        raise ValueError("--cores: no core")
    if not o.traces:
        raise ValueError("--traces: no trace")
    for name in o.traces:   # before the model is exported and any server starts
        if not trace_path(name, o.traces_dir).is_file():
            raise ValueError(f"--traces: no trace file {trace_path(name, o.traces_dir)} "
                             f"for {name!r}")
    if any(s.startswith("vllm") for s in o.systems) and not Path(o.vllm_python).exists():
        raise ValueError(f"no vLLM interpreter at {o.vllm_python}: run `make peer-vllm` or "
                         "pass --vllm-python")


def trace_path(name: str, traces_dir: str) -> Path:
    p = Path(name)
    return p if p.suffix in (".jsonl", ".gz") or p.is_file() else \
        Path(traces_dir) / f"{name}_trace.jsonl"


def trace_label(name: str) -> str:
    return Path(name).name.split("_trace")[0].split(".")[0]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write(doc: dict[str, Any], out: str) -> None:
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out)


def _warm(server: systems.Server, vocab: int, reserved_low: int) -> None:
    """Two short requests per URL (the first call of a server pays one-time costs)."""
    import random

    from pymooncake.workload import MaterializedRequest
    rng = random.Random(12345)
    reqs = [MaterializedRequest(index=-1 - i, timestamp_ms=0.0, token_ids=tuple(
        rng.randrange(reserved_low, vocab) for _ in range(96)), max_tokens=4, hash_ids=(),
        block_size=128) for i in range(2 * len(server.urls))]
    client.replay(server.urls, reqs, model=server.model, timeout_s=300, sequential=True)


def _skipped(n: int, why: str) -> dict[str, Any]:
    s = cap.summarize_point([])
    return s | {"num_requests": n, "bad_fraction": 1.0, "skipped": why}


def run_capacity(o: RunOptions, progress: Callable[[str], None] | None = None
                 ) -> dict[str, Any]:
    """Run the experiment; the document (also written to ``o.out`` after every point)."""
    import tempfile

    from pymooncake.bench.peer import prepare_model
    from pymooncake.bench.runner import cpu_model
    from pymooncake.workload import load_trace

    check_options(o)
    o.rates = sorted(o.rates)
    _stop_servers_on_signals()
    say = progress or (lambda m: None)
    tmp = tempfile.TemporaryDirectory(prefix="pymooncake-capacity-") if o.workdir is None \
        else None
    wd = Path(tmp.name if tmp else o.workdir)  # type: ignore[arg-type]
    wd.mkdir(parents=True, exist_ok=True)
    model_dir, vocab, _ = prepare_model(o.model, wd)
    mcfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = mcfg.get("head_dim") or mcfg["hidden_size"] // mcfg["num_attention_heads"]
    kv_per_token = 2 * mcfg["num_hidden_layers"] * mcfg["num_key_value_heads"] * head_dim * 4
    settings = systems.Settings(
        model_dir=Path(model_dir).absolute(), cores=o.cores, workdir=wd,
        vllm_python=str(Path(o.vllm_python).absolute()), vllm_threads=o.vllm_threads,
        block_size=o.block_size, max_model_len=o.max_model_len, kv_gib=o.kv_gib,
        kv_bytes_per_token=kv_per_token)
    labels = [trace_label(t) for t in o.traces]
    samples, trace_info = {}, {}
    for name, label in zip(o.traces, labels, strict=True):
        sample, info = client.select_sample(
            load_trace(trace_path(name, o.traces_dir)), o.requests,
            length_scale=o.length_scale, max_model_len=o.max_model_len, seed=o.seed)
        samples[label] = sample
        trace_info[label] = {"path": str(trace_path(name, o.traces_dir))} | info
    cfg = asdict(o) | {"traces": labels, "requests_per_point": o.requests,
                       "subsample": "requests subsampled (whole prefix families drawn at "
                                    "random), lengths only divided by the length scale",
                       "ours_kv_blocks": systems.ours_kv_blocks(settings),
                       "kv_bytes_per_token": kv_per_token}
    doc: dict[str, Any] = {
        "kind": cap.DOC_KIND, "version": cap.DOC_VERSION, "config": cfg, "traces": trace_info,
        "provenance": {"started_utc": _now(), "cpu_model": cpu_model(),
                       "cpus_online": os.cpu_count(), "cores": o.cores,
                       "machine": platform.machine(), "argv": sys.argv,
                       "model_dir": str(settings.model_dir), "model_config": mcfg,
                       "dtype": "float32", "versions": systems.versions(settings.vllm_python),
                       "commands": {}, "client": "in the harness process, unpinned"},
        "solo": {t: {} for t in labels}, "points": []}
    t_start = time.monotonic()
    try:
        _solo_phase(o, settings, doc, samples, vocab, say)
        _write(doc, o.out)
        _sweep(o, settings, doc, samples, vocab, say, t_start)
    finally:
        doc["provenance"]["finished_utc"] = _now()
        doc["provenance"]["wall_s"] = round(time.monotonic() - t_start, 1)
        _write(doc, o.out)
        if tmp is not None:
            tmp.cleanup()
    return doc


def _stop_servers_on_signals() -> None:
    """SIGTERM (and SIGINT, also where a background shell ignores it) raise
    ``KeyboardInterrupt``, so the ``finally`` blocks stop the servers (each runs in its own
    session and would outlive this process)."""
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def _seed(o: RunOptions, trace_i: int, rate_i: int) -> int:
    return o.seed + 1000 * (trace_i + 1) + rate_i


def _start(s: systems.Settings, name: str, tag: str, say: Callable[[str], None],
           *slo: float, tries: int = 2) -> systems.Server | None:
    """``systems.start`` with a retry; None (and the reason said) when it never starts."""
    for attempt in range(1, tries + 1):
        try:
            return systems.start(s, name, f"{tag}-try{attempt}" if attempt > 1 else tag, *slo)
        except systems.SystemError_ as e:
            say(f"{name} did not start (try {attempt}/{tries}): {e}")
    return None


def _solo_phase(o: RunOptions, s: systems.Settings, doc: dict[str, Any],
                samples: dict[str, Any], vocab: int, say: Callable[[str], None]) -> None:
    for name in o.systems:
        say(f"solo: starting {name}")
        server = _start(s, name, f"solo-{name}", say)
        if server is None:
            continue
        try:
            doc["provenance"]["commands"][name] = server.commands
            _warm(server, vocab, o.reserved_low)
            for ti, (label, sample) in enumerate(samples.items()):
                reqs = client.materialize(sample, vocab_size=vocab, length_scale=o.length_scale,
                                          seed=_seed(o, ti, 999), reserved_low=o.reserved_low
                                          )[:o.solo_requests]
                recs = client.replay(server.urls, reqs, model=server.model,
                                     timeout_s=o.request_timeout_s, sequential=True)
                summ = cap.summarize_point(recs)
                doc["solo"][label][name] = summ | {"records": client.compact(recs)}
                say(f"solo {label} {name}: p90 TTFT {summ['ttft_p90_s']} s, p90 TBT "
                    f"{summ['tbt_p90_s']} s ({summ['num_served']}/{len(recs)} served)")
        finally:
            server.stop()


def _sweep(o: RunOptions, s: systems.Settings, doc: dict[str, Any], samples: dict[str, Any],
           vocab: int, say: Callable[[str], None], t_start: float) -> None:
    total = len(samples) * o.repeats * len(o.systems)
    done = 0
    for ti, (label, sample) in enumerate(samples.items()):
        base = cap.solo_base(doc["solo"][label])
        loosest = max(o.multiples)
        slo = (o.admission_multiple * base["ttft_p90_s"],
               o.admission_multiple * base["tbt_p90_s"])
        doc["config"].setdefault("admission_slo_s", {})[label] = list(slo)
        reqs_by_rate = [client.materialize(client.at_rate(sample, r), vocab_size=vocab,
                                           length_scale=o.length_scale, seed=_seed(o, ti, ri),
                                           reserved_low=o.reserved_low)
                        for ri, r in enumerate(o.rates)]
        for rep in range(o.repeats):
            order = o.systems[rep % len(o.systems):] + o.systems[:rep % len(o.systems)]
            for name in order:
                done += 1
                say(f"{label} repeat {rep + 1}/{o.repeats}: {name} ({done}/{total}, "
                    f"{time.monotonic() - t_start:.0f} s)")
                server = _start(s, name, f"{label}-{rep}-{name}", say, *slo)
                if server is None:
                    doc["points"] += [{"trace": label, "system": name, "rate": rate,
                                       "repeat": rep, "seed": _seed(o, ti, ri),
                                       "started_utc": _now(), "records": [],
                                       "summary": _skipped(o.requests, "did not start")}
                                      for ri, rate in enumerate(o.rates)]
                    _write(doc, o.out)
                    continue
                fails = 0
                doc["provenance"].setdefault("sweep_commands", {}).setdefault(
                    label, {})[name] = server.commands
                try:
                    _warm(server, vocab, o.reserved_low)
                    for ri, rate in enumerate(o.rates):
                        reqs = reqs_by_rate[ri]
                        point = {"trace": label, "system": name, "rate": rate,
                                 "repeat": rep, "seed": _seed(o, ti, ri),
                                 "started_utc": _now()}
                        if fails >= o.stop_after:
                            point |= {"summary": _skipped(len(reqs), "saturated at lower "
                                                          "rates"), "records": []}
                            doc["points"].append(point)
                            continue
                        t0 = time.monotonic()
                        recs = client.replay(server.urls, reqs, model=server.model,
                                             timeout_s=o.request_timeout_s)
                        summ = cap.summarize_point(recs)
                        point |= {"wall_s": round(time.monotonic() - t0, 2), "summary": summ,
                                  "records": client.compact(recs)}
                        doc["points"].append(point)
                        why = server.alive()
                        ok = cap.point_ok(summ, loosest * base["ttft_p90_s"],
                                          loosest * base["tbt_p90_s"])
                        fails = 0 if ok else fails + 1
                        say(f"  {rate:g} req/s: p90 TTFT {summ['ttft_p90_s']} s, p90 TBT "
                            f"{summ['tbt_p90_s']} s, {summ['num_rejected']} rejected, "
                            f"{summ['num_failed']} failed of {summ['num_requests']}"
                            + (f"; {why}" if why else ""))
                        _write(doc, o.out)
                        if why:
                            fails = o.stop_after
                        time.sleep(o.settle_s)
                finally:
                    server.stop()
