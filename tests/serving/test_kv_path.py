"""The P→D KV path in one process (Transfer Engine ``local`` transport): the layer-wise
sender writes exactly the prefill engine's blocks into the receive buffer, and layer ``i``'s
write is submitted before layer ``i+1``'s compute starts (Mooncake FAST'25 §3.1 step 3)."""

from __future__ import annotations

import random
import time

import pytest

torch = pytest.importorskip("torch")


def test_layerwise_sender_writes_each_layer_before_the_next_layer_runs():
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.engine.kv_sender import KVSender, LayerwiseKVSender
    from pymooncake.transfer import TransferEngine

    pre = Engine.from_model_name("tiny", EngineConfig(role="prefill", num_kv_blocks=64))
    dec = Engine.from_model_name("tiny", EngineConfig(role="decode", num_kv_blocks=64))
    te = TransferEngine("kvpath", "embedded://").start()
    try:
        receiver = KVReceiver(te, dec.kv, 1 << 20)
        hook = LayerwiseKVSender(KVSender(te, pre.kv))
        submitted: list[float] = []
        orig = hook.after_layer

        def after_layer(layer, ctx, kv):
            orig(layer, ctx, kv)
            submitted.append(time.monotonic())

        hook.after_layer = after_layer  # type: ignore[method-assign]
        pre.runner.hooks.append(hook)
        prompt = [random.Random(3).randrange(256) for _ in range(40)]   # 2 full blocks
        target = receiver.reserve("r1", len(prompt) // 16)
        assert target is not None and target.num_blocks == 2
        hook.add("r1", target)
        pre.add_request(prompt, SamplingParams(max_tokens=1), "r1")
        outs = []
        while pre.has_unfinished():
            outs += pre.step()
        assert outs[0].request_id == "r1"
        sent, err, busy_s = hook.pop("r1")
        assert (sent, err) == (2, None) and busy_s > 0
        starts = pre.runner.layer_compute_start_s
        n_layers = pre.model.config.num_layers
        assert len(submitted) == len(starts) == n_layers
        for i in range(n_layers - 1):
            assert submitted[i] <= starts[i + 1], f"layer {i} written after layer {i + 1} ran"
        # the receive buffer holds exactly the prefill engine's blocks, in prompt order
        from pymooncake.identity import block_keys
        keys = block_keys(prompt, pre.namespace)
        receiver.mark_ready("r1", sent)
        got = receiver.blocks_of("r1")                 # [L, 2, H, N, bs, d]
        for j, key in enumerate(keys):
            block = pre.pool.get_cached_block(key, tuple(prompt[j * 16:(j + 1) * 16]))
            assert block is not None
            want = pre.kv.export_blocks([block.block_id])[:, :, :, 0]   # [L, 2, H, bs, d]
            assert torch.equal(got[:, :, :, j], want)
        receiver.release("r1")
        assert receiver.free_bytes == 1 << 20
    finally:
        te.close()


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
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.engine.kv_sender import KVSender, LayerwiseKVSender
    from pymooncake.engine.worker.stages import StageClock
    from pymooncake.transfer import TransferEngine

    pre = Engine.from_model_name("tiny", EngineConfig(role="prefill", num_kv_blocks=64))
    dec = Engine.from_model_name("tiny", EngineConfig(role="decode", num_kv_blocks=64))
    te = TransferEngine("kvclock", "embedded://").start()
    try:
        receiver = KVReceiver(te, dec.kv, 1 << 20)
        clock = StageClock("prefill", "queue")
        hook = LayerwiseKVSender(KVSender(te, pre.kv))
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
