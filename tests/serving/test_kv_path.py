"""The P→D KV path in one process (Transfer Engine ``local`` transport): the sender writes
exactly the prefill engine's blocks into the receive buffer, in prompt order (the layer-wise
hook's own tests: ``test_kv_layerwise.py``), and the decode side checks them against the
sender's digest. The prompt's partial last block moves too (layer-wise, or in the one batch
after the prefill, also for a parked prefill, whose blocks stay pinned until its target
comes), so the decode engine's first step computes only the first token."""

from __future__ import annotations

import random
import time

import pytest

torch = pytest.importorskip("torch")


def test_whole_block_send_keeps_prompt_order_for_any_block_ids():
    """``KVSender.send`` (the after-prefill path): runs of consecutive block ids are merged
    into one request per plane, and any other order still lands block by block."""
    from pymooncake.engine import Engine, EngineConfig
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.engine.kv_sender import KVSender
    from pymooncake.transfer import TransferEngine

    eng = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=16))
    gen = torch.Generator().manual_seed(0)
    eng.kv.buffer.copy_(torch.randn(eng.kv.buffer.shape, generator=gen))
    te = TransferEngine("kvsend", "embedded://").start()
    try:
        receiver = KVReceiver(te, eng.kv, 1 << 20)
        sender = KVSender(te, eng.kv)
        ids = [3, 4, 5, 9, 2]
        target = receiver.reserve("r", len(ids))
        reqs = sender.requests(ids, target)
        planes = eng.kv.num_layers * 2 * eng.kv.num_kv_heads
        assert len(reqs) == planes * 3          # runs [3, 4, 5], [9], [2]
        assert sender.send(ids, target) == len(ids) * eng.kv.block_nbytes
        got = receiver.blocks_of("r")
        for j, b in enumerate(ids):
            assert torch.equal(got[:, :, :, j], eng.kv.buffer[:, :, :, b])
    finally:
        te.close()


def test_stage_clock_shows_p2d_writes_overlapping_the_prefill():
    """Issue #6 item 7: stage windows with start/end so overlap is visible — the first
    layer's P→D write starts before the last layer's compute ends."""
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    from pymooncake.engine.kv_layerwise import LayerwiseKVSender
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.engine.kv_sender import KVSender
    from pymooncake.engine.worker.stages import StageClock
    from pymooncake.transfer import TransferEngine

    pre = Engine.from_model_name("tiny", EngineConfig(role="prefill", num_kv_blocks=64))
    dec = Engine.from_model_name("tiny", EngineConfig(role="decode", num_kv_blocks=64))
    te = TransferEngine("kvclock", "embedded://").start()
    try:
        receiver = KVReceiver(te, dec.kv, 1 << 20)
        clock = StageClock("prefill", "queue")
        hook = LayerwiseKVSender(KVSender(te, pre.kv), min_batch_bytes=0)   # per layer
        hook.clock = clock
        pre.runner.hooks[:0] = [clock, hook]
        prompt = [random.Random(5).randrange(256) for _ in range(300)]   # 18 full blocks
        target = receiver.reserve("r1", len(prompt) // 16)
        hook.add("r1", target)
        t_arrive = time.time()
        clock.arrive("r1", t_arrive)
        time.sleep(0.02)                                  # queued before its first step
        pre.add_request(prompt, SamplingParams(max_tokens=1), "r1")
        while pre.has_unfinished():
            pre.step()
        assert hook.pop("r1")[:2] == (18, None)
        windows = {name: (s, e) for name, s, e in clock.pop("r1")}
        assert set(windows) == {"queue", "prefill", "p2d_transfer"}
        q, pf, p2d = windows["queue"], windows["prefill"], windows["p2d_transfer"]
        assert q[0] == t_arrive and q[1] == pf[0] and q[1] - q[0] >= 0.02
        assert pf[0] < p2d[0] < pf[1] < p2d[1], (pf, p2d)   # overlapped, ends after compute
        assert clock.pop("r1") == ()                          # popped once
    finally:
        te.close()


# -- the prompt's partial last block (issue: the decode side recomputed the prompt's tail) --

BS = 128
PROMPT_LEN = 300                      # 2 full blocks of 128 + a partial one of 44 tokens


def _record_steps(engine) -> list[tuple[list[int], list[tuple[int, int, int, int]]]]:
    """Per step of ``engine``: tokens computed per request, and per load (first token,
    tokens, block ids, block keys)."""
    steps: list[tuple[list[int], list[tuple[int, int, int, int]]]] = []
    execute = engine.runner.execute

    def record(out):
        steps.append(([s.num_new_tokens for s in out.scheduled],
                      [(ld.first_token, ld.num_tokens, len(ld.block_ids), len(ld.block_keys))
                       for ld in out.loads]))
        return execute(out)

    engine.runner.execute = record  # type: ignore[method-assign]
    return steps


def _decode_after_pd(dec, receiver, rid: str, prompt: list[int], first: int,
                     num_sent_blocks: int, max_tokens: int, digest: int | None = None):
    """The decode worker's part (``DecodeWorker._start``): the prompt's KV is marked ready
    in ``receiver`` (with the sender's ``digest``) and prompt + first token run on
    ``dec``; (all tokens, the first one included; ``dec``'s steps as ``_record_steps``
    gives them; its output)."""
    from pymooncake.engine import SamplingParams
    steps = _record_steps(dec)
    receiver.mark_ready(rid, num_sent_blocks, len(prompt), digest)
    dec.add_request(prompt + [first], SamplingParams(max_tokens=max_tokens - 1,
                                                     ignore_eos=True), rid)
    outs = []
    try:
        while dec.has_unfinished():
            outs += dec.step()
    finally:
        del dec.runner.execute      # the class's method again
    (out,) = outs
    return [first, *out.output_token_ids], steps, out


def _reference(prompt: list[int], max_tokens: int) -> list[int]:
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    (ref,) = Engine.from_model_name("tiny", EngineConfig(block_size=BS, num_kv_blocks=16)
                                    ).generate([prompt], SamplingParams(max_tokens=max_tokens,
                                                                        ignore_eos=True))
    return list(ref.output_token_ids)


def _pd_pair(name: str):
    """A prefill and a decode engine (block size ``BS``) joined by a Transfer Engine: the
    decode engine loads from a ``KVReceiver`` of 8 blocks, the prefill engine writes with a
    ``LayerwiseKVSender``; (prefill, decode, transfer engine, receiver, sender hook)."""
    from pymooncake.engine import Engine, EngineConfig
    from pymooncake.engine.kv_layerwise import LayerwiseKVSender
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.engine.kv_sender import KVSender
    from pymooncake.transfer import TransferEngine

    pre = Engine.from_model_name("tiny", EngineConfig(role="prefill", block_size=BS,
                                                      num_kv_blocks=16))
    dec = Engine.from_model_name("tiny", EngineConfig(role="decode", block_size=BS,
                                                      num_kv_blocks=16))
    te = TransferEngine(name, "embedded://").start()
    receiver = KVReceiver(te, dec.kv, 8 * dec.kv.block_nbytes)
    dec.scheduler.kv_source = receiver
    dec.runner.hooks.append(receiver)
    hook = LayerwiseKVSender(KVSender(te, pre.kv))
    pre.runner.hooks.append(hook)
    return pre, dec, te, receiver, hook


def test_whole_prompt_kv_moves_with_its_partial_block_and_decode_computes_one_token():
    """A 300-token prompt at block size 128: the layer-wise sender ships 3 blocks (the
    last one partial) into a receive buffer of ceil(300 / 128) = 3; the decode engine
    loads all 300 prompt tokens and its first step computes only the first token (1 token,
    a plain decode step), with the greedy tokens of one colocated engine. The partial
    block has no key and is not cached (decoding does not fill it here)."""
    from pymooncake.engine import SamplingParams

    prompt = [random.Random(7).randrange(256) for _ in range(PROMPT_LEN)]
    max_tokens = 8
    ref = _reference(prompt, max_tokens)
    pre, dec, te, receiver, hook = _pd_pair("kvtail")
    try:
        target = receiver.reserve("r", -(-PROMPT_LEN // BS))
        assert target is not None and target.num_blocks == 3
        hook.add("r", target, PROMPT_LEN)
        pre.add_request(prompt, SamplingParams(max_tokens=1), "r")
        outs = []
        while pre.has_unfinished():
            outs += pre.step()
        first = outs[0].output_token_ids[0]
        sent, err, _, _ = hook.pop("r")
        assert (sent, err) == (3, None)
        toks, steps, out = _decode_after_pd(dec, receiver, "r", prompt, first, sent,
                                            max_tokens)
        assert steps[0] == ([1], [(0, PROMPT_LEN, 3, 2)])    # one token; 300 loaded
        assert all(n == [1] for n, _ in steps)                # every step a decode step
        assert out.num_cached_tokens == PROMPT_LEN
        assert toks == ref
        assert receiver.num_loaded_blocks == 3
        assert receiver.free_bytes == receiver.capacity_bytes
        assert dec.pool.num_cached_blocks == 2                # full blocks only (307 tokens)
        dec.kv_manager.check_integrity()
    finally:
        te.close()


@pytest.mark.parametrize("corrupt", [False, True])
def test_decode_checks_the_received_kv_against_the_senders_digest(corrupt):
    """The layer-wise sender's digest of the 3 blocks it sent (2 full + the partial one)
    is XXH3-64 of their bytes in receive-buffer order — computed here independently from
    ``export_blocks`` — and equals the receiver's digest of its buffer. One flipped byte in
    the buffer (a stale write landing after the space was reused) fails the check after the
    load: the step is undone, the decode engine recomputes the prompt (300 tokens, no load)
    and still produces the colocated engine's greedy tokens; the buffer cools."""
    import xxhash

    from pymooncake.engine import SamplingParams
    from pymooncake.engine.hooks import NullHooks
    from pymooncake.engine.kv_receiver import KV_CHECKSUM_FAILURES

    prompt = [random.Random(8).randrange(256) for _ in range(PROMPT_LEN)]
    max_tokens = 6
    ref = _reference(prompt, max_tokens)
    pre, dec, te, receiver, hook = _pd_pair("kvsum")
    try:
        table: list[int] = []

        class Table(NullHooks):                 # the request's block table, last step
            def start_step(self, ctx, kv):
                table[:] = ctx.seqs[0].block_ids

        pre.runner.hooks.append(Table())
        target = receiver.reserve("r", 3)
        hook.add("r", target, PROMPT_LEN)
        pre.add_request(prompt, SamplingParams(max_tokens=1), "r")
        outs = []
        while pre.has_unfinished():
            outs += pre.step()
        sent, err, _, digest = hook.pop("r")
        assert (sent, err) == (3, None)
        golden = xxhash.xxh3_64(pre.kv.export_blocks(table[:3]).numpy().tobytes()).intdigest()
        assert digest == golden
        receiver.mark_ready("r", sent, PROMPT_LEN)
        assert receiver.digest("r") == golden
        if corrupt:
            got = receiver.blocks_of("r")
            got[3, 1, 1, 2, 100, 7] += 1.0        # last layer, V, head 1, the partial block
            assert receiver.digest("r") != golden
        failures = KV_CHECKSUM_FAILURES._value.get()
        toks, steps, out = _decode_after_pd(dec, receiver, "r", prompt,
                                            outs[0].output_token_ids[0], sent, max_tokens,
                                            digest)
        assert toks == ref
        assert receiver.num_corrupt == int(corrupt)
        assert KV_CHECKSUM_FAILURES._value.get() - failures == int(corrupt)
        if corrupt:       # the checked step was undone; the prompt + first token computed
            assert steps[0][0] == [1] and steps[1] == ([PROMPT_LEN + 1], [])
            receiver.release("r")                # as the decode worker does at the end
            assert len(receiver._cooling) == 1    # not ready: reused last (COOL_S)
            assert receiver.free_bytes == receiver.capacity_bytes
        else:
            assert steps[0] == ([1], [(0, PROMPT_LEN, 3, 2)])
            assert receiver.num_loaded_blocks == 3
    finally:
        te.close()


def _set_and_parked(w, seeds: tuple[int, int], max_tokens: int):
    """Run ``PrefillWorker`` ``w`` on its own engine thread with two prompts of PROMPT_LEN
    tokens: "set", whose ``KVTarget`` comes with it, then "parked", a ``target_follows``
    prompt whose ``SetTarget`` is sent once it is parked; a decode engine (block size BS)
    then decodes each from what was shipped. Returns per request its ``PrefillResult``,
    the ``_decode_after_pd`` triple and its steps on ``w``'s engine (tokens per step), and
    the reference (one colocated engine's greedy tokens)."""
    import asyncio
    import threading

    from pymooncake.engine import Engine, EngineConfig
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.rpc.messages import PrefillTask, SamplingOptions, SetTarget

    prompts = {rid: [random.Random(seed).randrange(256) for _ in range(PROMPT_LEN)]
               for rid, seed in zip(("set", "parked"), seeds, strict=True)}
    refs = {rid: _reference(p, max_tokens) for rid, p in prompts.items()}
    greedy = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    dec = Engine.from_model_name("tiny", EngineConfig(role="decode", block_size=BS,
                                                      num_kv_blocks=16))

    async def main() -> dict[str, tuple]:
        w.loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = w.loop.create_future()
        go = threading.Event()
        t = threading.Thread(target=w._engine_thread, args=(started, go), daemon=True)
        t.start()
        await started            # start_resources ran on the engine thread
        pre_steps = _record_steps(w.engine)
        go.set()
        try:
            receiver = KVReceiver(w.transfer, dec.kv, 8 * dec.kv.block_nbytes)
            dec.scheduler.kv_source = receiver
            dec.runner.hooks.append(receiver)
            targets = {rid: receiver.reserve(rid, 3) for rid in prompts}
            res, chunks = {}, {}
            res["set"] = await asyncio.wait_for(w._prefill(PrefillTask(
                "set", tuple(prompts["set"]), greedy, targets["set"], use_store=False)), 30)
            chunks["set"] = [n for n, _ in pre_steps]
            pre_steps.clear()
            call = asyncio.ensure_future(w._prefill(PrefillTask(
                "parked", tuple(prompts["parked"]), greedy, None, use_store=False,
                target_follows=True)))
            for _ in range(3000):
                if "parked" in w._parked:
                    break
                await asyncio.sleep(0.01)
            assert "parked" in w._parked and not call.done()
            chunks["parked"] = [n for n, _ in pre_steps]
            assert await w._set_target(SetTarget("parked", targets["parked"]))
            res["parked"] = await asyncio.wait_for(call, 30)
            return {rid: (r, _decode_after_pd(dec, receiver, rid, prompts[rid],
                                              r.first_token_id, r.num_sent_blocks,
                                              max_tokens), chunks[rid], refs[rid])
                    for rid, r in res.items()}
        finally:
            w._stop.set()
            await asyncio.to_thread(t.join, 5.0)
            w.close_resources()

    return asyncio.run(main())


def test_one_batch_ship_sends_the_partial_block_of_a_set_and_of_a_parked_prefill():
    """``PrefillWorker`` with layer-wise writes off (as a CPP instance runs): a prefill
    whose ``KVTarget`` is set when it ends ships all 3 blocks right after it (the partial
    one from the step that just ended) and the decode side computes 1 token; a
    ``target_follows`` prefill that ended before its ``SetTarget`` (parked) ships all 3
    as well (its blocks stayed pinned: the partial one is not in the prefix cache), so its
    decode side computes 1 token too, not the 44-token tail. Both give one colocated
    engine's greedy tokens; no pin is left behind."""
    from pymooncake.engine.worker.base import WorkerConfig
    from pymooncake.engine.worker.prefill import PrefillWorker

    w = PrefillWorker(WorkerConfig(
        "ptail", "prefill", "127.0.0.1:1", metadata_url="embedded://ptail",
        num_kv_blocks=16, block_size=BS, layerwise_kv=False, startup_profile_tokens=0))
    got = _set_and_parked(w, (11, 12), 6)
    assert w.layerwise is None
    r, (toks, steps, _), _, ref = got["set"]
    assert r.num_sent_blocks == 3
    assert steps[0] == ([1], [(0, PROMPT_LEN, 3, 2)])
    assert toks == ref
    r, (toks, steps, _), _, ref = got["parked"]
    assert r.num_sent_blocks == 3
    assert steps[0] == ([1], [(0, PROMPT_LEN, 3, 2)])
    assert toks == ref
    assert not w._parked and w.engine.pool.num_free_blocks == 16


def test_buffer_freed_before_its_kv_was_ready_is_reused_last():
    """A receive buffer released before ``mark_ready`` (its prefill died or was aborted
    mid-write, so frames for it may still land) is not given to the next request while other
    space fits (``kv_receiver.COOL_S``); when nothing else fits it is, at once. A buffer
    released after its KV was loaded is reused at once as before."""
    from pymooncake.engine import Engine, EngineConfig
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.transfer import TransferEngine

    eng = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=16))
    nb = eng.kv.block_nbytes
    te = TransferEngine("kvcool", "embedded://").start()
    try:
        receiver = KVReceiver(te, eng.kv, 4 * nb)          # room for 4 one-block buffers
        first = receiver.reserve("aborted", 1)
        receiver.release("aborted")                         # never ready: cooling
        assert receiver.free_bytes == 4 * nb
        others = [receiver.reserve(f"r{i}", 1) for i in range(3)]
        assert first.addr not in {t.addr for t in others}   # the other space went first
        last = receiver.reserve("r3", 1)                    # nothing else fits: reused now
        assert last is not None and last.addr == first.addr
        assert receiver.reserve("r4", 1) is None
        receiver.mark_ready("r0", 1)
        receiver.release("r0")                              # loaded: free at once
        assert receiver.reserve("r5", 1).addr == others[0].addr
    finally:
        te.close()


def test_prefill_worker_takes_a_prompt_in_one_step_and_a_targetless_one_in_capped_chunks(
        monkeypatch):
    """``PrefillWorker`` (layer-wise writes, prefill_batch 1): a prompt with its ``KVTarget``
    is one step (chunk = the 2,048-token budget), the decode side computes 1 token; a
    ``target_follows`` one runs in ``TARGET_WAIT_CHUNK_TOKENS`` chunks (patched to 128) until
    its target comes — never, here: parked, it ships its pinned blocks, the partial one
    too. Both match greedy."""
    from pymooncake.engine.worker import prefill as prefill_mod
    from pymooncake.engine.worker.base import WorkerConfig
    from pymooncake.engine.worker.prefill import PrefillWorker

    monkeypatch.setattr(prefill_mod, "TARGET_WAIT_CHUNK_TOKENS", BS)
    w = PrefillWorker(WorkerConfig(
        "pchunk", "prefill", "127.0.0.1:1", metadata_url="embedded://pchunk",
        num_kv_blocks=16, block_size=BS, startup_profile_tokens=0))
    got = _set_and_parked(w, (21, 22), 5)
    assert w.layerwise is not None and w.engine.config.prefill_chunk_tokens == 2048
    r, (toks, steps, _), chunks, ref = got["set"]
    assert chunks == [[PROMPT_LEN]]                               # one step
    assert r.num_sent_blocks == 3                                 # layer-wise, partial too
    assert steps[0] == ([1], [(0, PROMPT_LEN, 3, 2)])
    assert toks == ref
    r, (toks, steps, _), chunks, ref = got["parked"]
    assert chunks == [[BS], [BS], [PROMPT_LEN - 2 * BS]]          # capped chunks
    assert r.num_sent_blocks == 3
    assert steps[0] == ([1], [(0, PROMPT_LEN, 3, 2)])
    assert toks == ref
    assert not w._parked and w.engine.pool.num_free_blocks == 16
