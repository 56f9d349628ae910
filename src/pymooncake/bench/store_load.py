"""``pymooncake bench store-load``: how much of a Store prefix load compute hides.

A request whose prefix another worker put into the Mooncake Store (Mooncake FAST'25 §3.1
step 1; issue 16 "Done when": ≥ 50 % of the load hidden for prompts ≥ 2k tokens on
``smollm2``). Real processes: a master and a store server (the other worker's DRAM
segment, which holds the blocks) on this host. In this process a writer engine prefills
``prefix + suffix`` once and puts the prefix's blocks into the Store through its own
client (no segment of its own, so the replicas live in the store server); a reader engine
(prefill role, no local prefix cache, so every repeat loads from the Store) then serves
the same prompt in each load mode of ``StoreKVLoader`` (``sync``: the engine thread waits
for the whole load, the old behaviour; ``async``: the request waits off the step thread
for all layers; ``layerwise``: it computes once layer group 0 is in, the later groups
arrive while earlier layers compute), in interleaved repeats.

Per run: TTFT (request added → first token), the Store read window (first ranged read
start → last read end; ``kv_fetch.BlockFetch.timeline``), the compute window (the
request's steps: ``StageClock``'s ``prefill`` window) and the hidden fraction
(``kv_fetch.hidden_fraction``: read time overlapped by compute, minus the engine's waits
for a group, over the read time). The first token is checked against the writer's.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from pymooncake.bench.failover import Child, free_port

MODES = ("sync", "async", "layerwise")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(model: str = "smollm2", prefix_tokens: int = 2048, suffix_tokens: int = 512,
        repeats: int = 3, modes: tuple[str, ...] = MODES, transports: str = "shm,tcp",
        seed: int = 0, threads: int = 1) -> dict[str, Any]:
    """Run the benchmark; returns per-mode medians and every run (see module docstring).

    Raises ``ValueError`` for a prefix that is not a positive multiple of the block size,
    a suffix < 1 or an unknown mode."""
    from pymooncake.engine import Engine, EngineConfig
    from pymooncake.engine.kv_fetch import hidden_fraction
    from pymooncake.engine.kv_loader import LOAD_MODES, StoreKVLoader
    from pymooncake.engine.sampling import SamplingParams
    from pymooncake.engine.worker.stages import StageClock
    from pymooncake.store.client import StoreClient
    from pymooncake.transfer import TransferConfig

    bad = [m for m in modes if m not in LOAD_MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}: use {', '.join(LOAD_MODES)}")
    if suffix_tokens < 1:
        raise ValueError(f"--suffix-tokens {suffix_tokens}: at least 1 token is computed")
    total = prefix_tokens + suffix_tokens
    blocks = -(-total // 16) + 8
    cfg = EngineConfig(role="prefill", num_kv_blocks=blocks, num_threads=threads,
                       max_num_batched_tokens=max(2048, suffix_tokens))
    writer = Engine.from_model_name(model, cfg)
    bs = writer.config.block_size
    if prefix_tokens <= 0 or prefix_tokens % bs:
        raise ValueError(f"--prefix-tokens {prefix_tokens}: a positive multiple of the "
                         f"block size {bs}")
    rng = random.Random(seed)
    vocab = writer.model.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(total)]
    tc = TransferConfig(transports=tuple(transports.split(",")))
    procs: list[Child] = []
    clients: list[StoreClient] = []
    try:
        master = Child(["master", "--port", "0", "--enable-http-metadata-server",
                        "--http-metadata-server-port", str(free_port())])
        procs.append(master)
        addr, md = f"127.0.0.1:{master.port}", master.info["metadata_url"]
        seg = 2 * (prefix_tokens // bs) * writer.kv.block_nbytes + (64 << 20)
        procs.append(Child(["store-server", "--master", addr, "--metadata", md,
                            "--global-segment-size", str(seg), "--transports", transports]))
        # the writer: full prefill once (the reference first token), prefix blocks put
        ns = writer.namespace.digest()
        t0 = time.monotonic()
        (ref,) = writer.generate([prompt], SamplingParams(max_tokens=1))
        writer_prefill_s = time.monotonic() - t0
        exported = writer.export_blocks(prompt[:prefix_tokens])
        wclient = StoreClient(addr, md, transfer_config=tc).start()
        clients.append(wclient)
        put = StoreKVLoader(wclient, writer.kv, ns, staging_blocks=0).put_blocks(
            [b.block_key for b in exported], [b.data for b in exported])
        if len(put) != prefix_tokens // bs:
            raise RuntimeError(f"only {len(put)} of {prefix_tokens // bs} blocks were put")
        del writer
        # the reader: no prefix cache of its own, so each repeat loads from the Store
        rcfg = EngineConfig(role="prefill", num_kv_blocks=blocks, num_threads=threads,
                            enable_prefix_caching=False,
                            max_num_batched_tokens=max(2048, suffix_tokens))
        reader = Engine.from_model_name(model, rcfg)
        rclient = StoreClient(addr, md, transfer_config=tc).start()
        clients.append(rclient)
        clock = StageClock("prefill", "queue")
        reader.runner.hooks.insert(0, clock)
        loaders = {m: StoreKVLoader(rclient, reader.kv, ns, mode=m,
                                    staging_blocks=prefix_tokens // bs + 1) for m in modes}
        runs: list[dict[str, Any]] = []
        for rep in range(repeats + 1):  # repeat 0 warms every mode up (not reported)
            for m in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                ld = loaders[m]
                ld.clock = clock
                reader.scheduler.kv_source = ld
                reader.runner.hooks = [clock, ld]
                rid = f"{m}-{rep}"
                t_add = time.time()
                reader.add_request(prompt, SamplingParams(max_tokens=1), rid)
                outs: list[Any] = []
                while reader.has_unfinished():
                    outs += reader.step()
                ttft = time.time() - t_add
                windows = {w[0]: (w[1], w[2]) for w in clock.pop(rid)}
                f = ld.timelines.get(rid)
                ld.forget(rid)
                if f is None or "prefill" not in windows:
                    raise RuntimeError(f"{rid}: no Store load happened ({outs})")
                read = f.read_window()
                assert read is not None
                lookup = next(w for w in f.timeline if w[0] == "lookup")
                waits = sum(t1 - t0 for k, t0, t1 in f.timeline if k == "wait")
                if rep == 0:
                    continue
                runs.append({
                    "mode": m, "repeat": rep, "ttft_s": ttft,
                    "lookup_s": lookup[2] - lookup[1], "read_s": read[1] - read[0],
                    "compute_s": windows["prefill"][1] - windows["prefill"][0],
                    "wait_s": waits,
                    "hidden_fraction": hidden_fraction(f, windows["prefill"]),
                    "cached_tokens": outs[0].num_cached_tokens,
                    "first_token_ok": outs[0].output_token_ids == ref.output_token_ids})
        for ld in loaders.values():
            ld.close()
    finally:
        for c in clients:
            c.close()
        for p in reversed(procs):
            p.kill()
    summary = {m: {k: _median([r[k] for r in runs if r["mode"] == m])
                   for k in ("ttft_s", "lookup_s", "read_s", "compute_s", "wait_s",
                             "hidden_fraction")} for m in modes}
    return {"model": model, "prefix_tokens": prefix_tokens, "suffix_tokens": suffix_tokens,
            "block_bytes": reader.kv.block_nbytes, "transports": transports,
            "repeats": repeats, "writer_full_prefill_s": writer_prefill_s,
            "all_first_tokens_ok": all(r["first_token_ok"] for r in runs),
            "all_prefix_loaded": all(r["cached_tokens"] == prefix_tokens for r in runs),
            "medians": summary, "runs": runs}


def format_report(res: dict[str, Any]) -> str:
    lines = [f"{res['model']}: prompt {res['prefix_tokens']} Store-held + "
             f"{res['suffix_tokens']} new tokens, block {res['block_bytes']} B, "
             f"transports {res['transports']}, {res['repeats']} interleaved repeats "
             f"(medians)",
             f"{'mode':10} {'TTFT s':>8} {'lookup s':>9} {'read s':>8} {'compute s':>10} "
             f"{'wait s':>7} {'hidden':>7}"]
    for m, s in res["medians"].items():
        lines.append(f"{m:10} {s['ttft_s']:8.3f} {s['lookup_s']:9.3f} {s['read_s']:8.3f} "
                     f"{s['compute_s']:10.3f} {s['wait_s']:7.3f} {s['hidden_fraction']:7.0%}")
    lines.append(f"first token equal to the writer's full prefill: "
                 f"{res['all_first_tokens_ok']}; whole prefix loaded every run: "
                 f"{res['all_prefix_loaded']}")
    return "\n".join(lines)
