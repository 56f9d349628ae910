"""Store prefix loads off the step thread (issue 16 item 3), against a real master and
store server: a running decode batch keeps its TBT while other requests' prefixes load
from the Store, and a layer-wise load gives the same tokens as a full prefill."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.integration

PREFIX_BLOCKS = 64
"""Blocks of each loaded prefix (tiny model: 32 KiB each, 2 MiB per load)."""
DELAY_S = 0.1
"""How late the slowed Store's replica plans answer (s)."""


def _engine(num_kv_blocks: int = 4096):
    from pymooncake.engine import Engine, EngineConfig
    return Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=num_kv_blocks))


def _put_prefixes(cl, prompts: list[list[int]]) -> None:
    """A writer engine prefills each prompt and puts its prefix blocks into the Store
    (through a client without a segment: the replicas live in the store server)."""
    from pymooncake.engine.kv_loader import StoreKVLoader
    from pymooncake.engine.sampling import SamplingParams
    w = _engine()
    w.generate(prompts, SamplingParams(max_tokens=1))
    put = StoreKVLoader(cl.client(), w.kv, w.namespace.digest(), staging_blocks=0)
    for p in prompts:
        blocks = w.export_blocks(p[:PREFIX_BLOCKS * 16])
        assert len(blocks) == PREFIX_BLOCKS
        keys = [b.block_key for b in blocks]
        assert put.put_blocks(keys, [b.data for b in blocks]) == keys


def _prompt(i: int) -> list[int]:
    rng = np.random.default_rng(1000 + i)
    return rng.integers(3, 250, PREFIX_BLOCKS * 16 + 1).tolist()


def _p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99))


class _SlowStore:
    """A real Store client whose replica plans answer ``delay_s`` late: a far or busy
    Store, slowed on purpose so a load lasts many decode steps (issue 16 item 8).
    ``units``: ``(start, end, thread CPU s)`` of every plan and ranged read it served."""

    def __init__(self, client, delay_s: float) -> None:
        self._client, self.delay_s = client, delay_s
        self.units: list[tuple[float, float, float]] = []

    def open_reads(self, keys):
        time.sleep(self.delay_s)
        return _TimedReads(self, self._timed(self._client.open_reads, keys))

    def _timed(self, fn, *args):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            self.units.append((t0, time.perf_counter(), time.thread_time() - c0))

    def cpu_inside(self, t0: float, t1: float) -> float:
        """Fetch-thread CPU seconds of the units that overlapped ``[t0, t1]`` (pro rata)."""
        return sum(c * max(0.0, min(t1, b) - max(t0, a)) / max(b - a, 1e-9)
                   for a, b, c in self.units)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


class _TimedReads:
    def __init__(self, store: _SlowStore, reader) -> None:
        self._store, self._reader, self.sizes = store, reader, reader.sizes

    def read(self, ranges):
        return self._store._timed(self._reader.read, ranges)

    def close(self):
        return self._reader.close()


def test_decode_tbt_does_not_grow_while_prefixes_load_from_the_store(
        cluster_factory) -> None:
    """Four requests decode; every ``every`` steps one more request arrives whose 64-block
    prefix is either in the engine's local prefix cache ("without": no Store load) or
    only in the Store ("with"), whose lookups answer ``DELAY_S`` late (slowed on purpose:
    each load then lasts tens of decode steps). Each phase's TBT samples are the batch's
    step times (its 4 requests sample every step); ``rounds`` interleaved rounds.

    Checked: the batch kept stepping while loads were in flight (a synchronous load —
    ``STORE_LOAD_MODE=sync``, the old behaviour — runs inside one step: none), the fetch
    thread was paced while the batch stepped (``kv_pacing``: it slept its share), every
    prefix was loaded, and the best-of-rounds p99 TBT with loads exceeds the one
    without by less than half the load's delay (a synchronous load puts the whole delay
    into one step of every round; the best of several rounds drops rounds in which
    another process took the core: on this shared machine they only ever add time).

    Not asserted: the issue's "within 20 %". The load's CPU work (one plan RPC, 64
    transfer requests and their checksums) runs under the same GIL as the decode step;
    paced to ``kv_pacing.LOAD_SHARE`` (10 % of a core, the default) while the batch decodes
    it adds about that share to the steps it overlaps: on a quiet 2-core machine the
    printed best-of-8-rounds ratio was 1.10-1.20 in 6 runs (1.30-1.48 unpaced), but on a
    shared machine the p99 of a phase is set by other processes taking the core (p99/p50
    of the steps without loads: 2-3x), so the ratio is printed, not asserted
    (docs/benchmarks.md, issue 16: the figures and the command that measures them)."""
    import os

    from pymooncake.engine.kv_loader import StoreKVLoader
    from pymooncake.engine.kv_pacing import LOAD_SHARE
    from pymooncake.engine.sampling import SamplingParams

    from .procs import MiB

    # TBT_ROUNDS, STORE_LOAD_SHARE: the benchmark's knobs (docs/benchmarks.md, issue 16)
    rounds, steps, every = int(os.environ.get("TBT_ROUNDS", "5")), 30, 10
    share = float(os.environ.get("STORE_LOAD_SHARE", str(LOAD_SHARE)))
    delay_s = DELAY_S
    loads = steps // every
    cl = cluster_factory()
    cl.store_server(max(64, 8 * rounds) * MiB)  # 2 MiB per prefix, below the watermark
    n = rounds * loads
    store_prompts = [_prompt(i) for i in range(n)]
    local_prompts = [_prompt(n + i) for i in range(n)]
    _put_prefixes(cl, store_prompts)

    eng = _engine()
    mode = os.environ.get("STORE_LOAD_MODE", "layerwise")
    store = _SlowStore(cl.client(), delay_s)
    loader = StoreKVLoader(store, eng.kv, eng.namespace.digest(), mode=mode,
                           load_share=share)
    eng.generate(local_prompts, SamplingParams(max_tokens=1))  # into the local cache
    eng.scheduler.kv_source = loader
    eng.runner.hooks.append(loader)
    try:
        for i in range(4):
            eng.add_request(_prompt(10_000 + i)[:32],
                            SamplingParams(max_tokens=4000, ignore_eos=True), f"d{i}")
        for _ in range(5):  # the batch is decoding
            eng.step()
        loadavg = [os.getloadavg()[0]]
        p99s: dict[str, list[tuple[float, float]]] = {"with": [], "without": []}
        pooled: dict[str, list[float]] = {"with": [], "without": []}
        windows: list[tuple[float, float]] = []  # steps of the "with" phases
        in_flight_steps = 0
        for r in range(rounds):
            p99 = {}
            for phase in ("without", "with") if r % 2 == 0 else ("with", "without"):
                prompts = store_prompts if phase == "with" else local_prompts
                tbt = []
                s = 0  # until the phase's requests are done: the steps they join included
                while s < steps or any(not rid.startswith("d") for rid in eng.requests):
                    if s < steps and s % every == 0:
                        j = r * loads + s // every
                        eng.add_request(prompts[j], SamplingParams(max_tokens=1),
                                        f"{phase}-{j}")
                    in_flight_steps += any(not f.done for f in loader._fetches.values())
                    t0, c0 = time.perf_counter(), time.thread_time()
                    eng.step()
                    tbt.append((time.perf_counter() - t0, time.thread_time() - c0))
                    if phase == "with":
                        windows.append((t0, t0 + tbt[-1][0]))
                    s += 1
                pooled[phase] += [w for w, _ in tbt]
                p99[phase] = (_p99([w for w, _ in tbt]), _p99([c for _, c in tbt]))
            for phase, v in p99.items():
                p99s[phase].append(v)
        loadavg.append(os.getloadavg()[0])
        done = {rid: eng.requests.get(rid) for rid in ("d0", "d1", "d2", "d3")}
        assert all(req is not None and not req.is_finished for req in done.values())
    finally:
        loader.close()
    best = {ph: (min(w for w, _ in v), min(c for _, c in v)) for ph, v in p99s.items()}
    wall, cpu = (best["with"][i] / best["without"][i] for i in (0, 1))
    print(f"p99 TBT ({mode}), best of {rounds} rounds, with / without Store loads: wall "
          f"{best['with'][0] * 1e3:.1f} / {best['without'][0] * 1e3:.1f} ms = {wall:.2f}, "
          f"engine thread CPU {best['with'][1] * 1e3:.1f} / "
          f"{best['without'][1] * 1e3:.1f} ms = {cpu:.2f}; load average {loadavg}")
    q = {ph: [float(np.percentile(v, x)) * 1e3 for x in (50, 90, 99)]
         for ph, v in pooled.items()}
    inside = [store.cpu_inside(a, b) * 1e3 for a, b in windows]
    load_s = [f.timeline[-1][2] - f.timeline[0][1] for f in loader.timelines.values()]
    print(f"share {share}: all steps p50/p90/p99 with " + "/".join(f"{x:.1f}" for x in q["with"])
          + " ms, without " + "/".join(f"{x:.1f}" for x in q["without"]) + " ms, ratios "
          + "/".join(f"{a / b:.2f}" for a, b in zip(q["with"], q["without"], strict=True))
          + f"; fetch CPU inside one step p99 {np.percentile(inside, 99):.2f} ms, max "
          f"{max(inside):.2f} ms; load (lookup start -> last read end, with the "
          f"{delay_s * 1e3:.0f} ms delay) median {np.median(load_s) * 1e3:.0f} ms; "
          f"paced {loader.pacer.paced_s:.2f} s")
    # every Store prompt's prefix was loaded, not recomputed
    assert loader.num_loaded_blocks == n * PREFIX_BLOCKS
    assert in_flight_steps >= n, f"only {in_flight_steps} steps ran while loads were in flight"
    if mode == "layerwise" and share < 1:
        assert loader.pacer.paced_s > 0, "the fetch thread was never paced while the batch ran"
    grew = best["with"][0] - best["without"][0]
    assert grew < delay_s / 2, (f"p99 TBT grew {grew * 1e3:.1f} ms with Store loads of "
                                f"{delay_s * 1e3:.0f} ms: a load is inside a step")

def test_layerwise_load_gives_the_tokens_of_a_full_prefill(cluster_factory) -> None:
    """A request whose 64-block prefix is in the Store, into an idle engine: it joins a
    step as soon as its lookup is done and its layer groups arrive while its suffix
    computes; its greedy tokens equal a full prefill's, and the loader's timeline shows
    the lookup, then one read per layer group, in order (the tiny model's 32 KiB block
    is one checksum chunk: one group, ``kv_fetch.chunk_groups``)."""
    from pymooncake.engine.kv_loader import StoreKVLoader
    from pymooncake.engine.sampling import SamplingParams

    from .procs import MiB

    cl = cluster_factory()
    cl.store_server(64 * MiB)
    prompt = _prompt(7) + list(range(40, 90))  # 64 Store blocks + 51 new tokens
    ref = _engine()
    (want,) = ref.generate([prompt], SamplingParams(max_tokens=8))
    _put_prefixes(cl, [prompt])
    eng = _engine()
    loader = StoreKVLoader(cl.client(), eng.kv, eng.namespace.digest())
    eng.scheduler.kv_source = loader
    eng.runner.hooks.append(loader)
    try:
        (got,) = eng.generate([prompt], SamplingParams(max_tokens=8))
    finally:
        loader.close()
    assert got.output_token_ids == want.output_token_ids
    assert got.num_cached_tokens == PREFIX_BLOCKS * 16
    f = loader.timelines[got.request_id]
    kinds = [k for k, _, _ in f.timeline if k != "wait"]
    assert kinds == ["lookup"] + ["read"] * len(loader.fetcher.groups)
    starts = [t0 for k, t0, _ in f.timeline if k == "read"]
    assert starts == sorted(starts)
