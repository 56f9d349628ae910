"""``LayerwiseKVSender`` (``engine/kv_layerwise.py``) in one process: each layer's write
goes before the next layer runs, small layers go together in batches of at least
``min_batch_bytes``, and a step that stops partway leaves its blocks unsent for the re-run;
the receive buffer always ends up holding exactly the prefill engine's blocks."""

from __future__ import annotations

import random
import time

import pytest

torch = pytest.importorskip("torch")


def test_layerwise_sender_writes_each_layer_before_the_next_layer_runs():
    """``min_batch_bytes=0``: every layer is its own batch (a step moving at least
    ``MIN_BATCH_BYTES`` a layer behaves so by default)."""
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    from pymooncake.engine.kv_layerwise import LayerwiseKVSender
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.engine.kv_sender import KVSender
    from pymooncake.transfer import TransferEngine

    pre = Engine.from_model_name("tiny", EngineConfig(role="prefill", num_kv_blocks=64))
    dec = Engine.from_model_name("tiny", EngineConfig(role="decode", num_kv_blocks=64))
    te = TransferEngine("kvpath", "embedded://").start()
    try:
        receiver = KVReceiver(te, dec.kv, 1 << 20)
        hook = LayerwiseKVSender(KVSender(te, pre.kv), min_batch_bytes=0)
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
        sent, err, busy_s, _ = hook.pop("r1")
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


def _assert_received_exact(pre, receiver, hook, rid: str, prompt: list[int],
                           num_blocks: int) -> None:
    """``hook`` sent ``num_blocks`` blocks of ``rid`` without error, and the receive buffer
    holds each exactly as ``pre``'s prefix cache does (block size 16); frees the buffer."""
    from pymooncake.identity import block_keys

    sent, err, _, _ = hook.pop(rid)
    assert (sent, err) == (num_blocks, None)
    receiver.mark_ready(rid, sent)
    got = receiver.blocks_of(rid)                      # [L, 2, H, N, bs, d]
    for j, key in enumerate(block_keys(prompt, pre.namespace)):
        block = pre.pool.get_cached_block(key, tuple(prompt[j * 16:(j + 1) * 16]))
        assert torch.equal(got[:, :, :, j], pre.kv.export_blocks([block.block_id])[:, :, :, 0])
    receiver.release(rid)


@pytest.mark.parametrize("min_batch_bytes", [None, 3])
def test_small_layers_are_written_together_and_arrive_exact(min_batch_bytes):
    """A step whose layers are small goes in batches of at least ``min_batch_bytes``:
    with the default (1 MiB) a 40-token prompt's 4 layers (2 blocks, 16 KiB a layer on the
    tiny model) are one batch, submitted after the last layer; with 3 layers' worth, layers
    0-2 go together after layer 2 and layer 3 after itself. Every block arrives exact."""
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    from pymooncake.engine.kv_layerwise import LayerwiseKVSender
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.engine.kv_sender import KVSender
    from pymooncake.transfer import TransferEngine

    pre = Engine.from_model_name("tiny", EngineConfig(role="prefill", num_kv_blocks=64))
    dec = Engine.from_model_name("tiny", EngineConfig(role="decode", num_kv_blocks=64))
    layer_nbytes = 2 * pre.kv.block_nbytes_per_layer            # 2 full blocks
    assert layer_nbytes == 2 * 2 * 16 * 2 * 32 * 4              # K/V x 16 tok x 2 heads x 32
    te = TransferEngine("kvbatch", "embedded://").start()
    try:
        receiver = KVReceiver(te, dec.kv, 1 << 20)
        kw = {} if min_batch_bytes is None else {"min_batch_bytes": min_batch_bytes
                                                 * layer_nbytes}
        sender = KVSender(te, pre.kv)
        hook = LayerwiseKVSender(sender, **kw)
        batches: list[tuple[int, int]] = []       # (layers in it, after which layer)
        orig = sender.requests
        seen: list[int] = []

        def requests(block_ids, target, layers=None, first_block=0):
            batches.append((len(layers), seen[-1]))
            return orig(block_ids, target, layers, first_block)

        def after_layer(layer, ctx, kv, _orig=hook.after_layer):
            seen.append(layer)
            _orig(layer, ctx, kv)

        sender.requests = requests                 # type: ignore[method-assign]
        hook.after_layer = after_layer             # type: ignore[method-assign]
        pre.runner.hooks.append(hook)
        prompt = [random.Random(4).randrange(256) for _ in range(40)]   # 2 full blocks
        target = receiver.reserve("r1", 2)
        hook.add("r1", target)
        pre.add_request(prompt, SamplingParams(max_tokens=1), "r1")
        while pre.has_unfinished():
            pre.step()
        assert batches == ([(4, 3)] if min_batch_bytes is None else [(3, 2), (1, 3)])
        _assert_received_exact(pre, receiver, hook, "r1", prompt, 2)
    finally:
        te.close()


@pytest.mark.parametrize("min_batch_bytes", [0, None])
def test_step_that_fails_midway_leaves_its_blocks_unsent_and_the_recompute_sends_them(
        min_batch_bytes):
    """A step that stops after layer 1 (its Store load of layer 2 failed, policy
    ``recompute``) sent some layers at most: its blocks do not count as sent, and the
    recompute writes every layer of them, so the receive buffer holds exactly the prefill
    engine's blocks (review of the batched writes: ``sent_blocks`` used to advance anyway,
    and the recompute then skipped the blocks whose later layers never went)."""
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    from pymooncake.engine.hooks import KVLoadError, NullHooks
    from pymooncake.engine.kv_layerwise import LayerwiseKVSender
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.engine.kv_sender import KVSender
    from pymooncake.transfer import TransferEngine

    class FailLayer2Once(NullHooks):
        failed = False

        def before_layer(self, layer, ctx, kv):
            if layer == 2 and not self.failed:
                self.failed = True
                raise KVLoadError("layer 2 of the load did not arrive", ("r1",))

    pre = Engine.from_model_name("tiny", EngineConfig(role="prefill", num_kv_blocks=64))
    dec = Engine.from_model_name("tiny", EngineConfig(role="decode", num_kv_blocks=64))
    te = TransferEngine("kvfail", "embedded://").start()
    try:
        receiver = KVReceiver(te, dec.kv, 1 << 20)
        kw = {} if min_batch_bytes is None else {"min_batch_bytes": min_batch_bytes}
        hook = LayerwiseKVSender(KVSender(te, pre.kv), **kw)
        fail = FailLayer2Once()
        pre.runner.hooks += [hook, fail]
        prompt = [random.Random(6).randrange(256) for _ in range(40)]   # 2 full blocks
        target = receiver.reserve("r1", 2)
        hook.add("r1", target)
        pre.add_request(prompt, SamplingParams(max_tokens=1), "r1")
        assert pre.step() == []                       # the failed step: r1 recomputes
        assert fail.failed and hook.sent_blocks["r1"] == 0
        while pre.has_unfinished():
            pre.step()
        _assert_received_exact(pre, receiver, hook, "r1", prompt, 2)
    finally:
        te.close()
