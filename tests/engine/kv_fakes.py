"""An in-process external KV tier for engine unit tests (the real one is the Store/Transfer
Engine of the serving issue): serves exported blocks layer by layer from a loader thread,
with injectable per-layer delay and failure."""

from __future__ import annotations

import threading
import time

import torch

from pymooncake.engine import ExportedBlock
from pymooncake.engine.hooks import KVLoadError, NullHooks, StepContext
from pymooncake.engine.kv.kv_tensors import KVTensors


class FakeExternalTier(NullHooks):
    """Holds whole blocks (all layers) by block key; loads them into the target blocks one
    layer after another on a thread; ``before_layer`` waits for that layer (BUG-39)."""

    def __init__(self, blocks: list[ExportedBlock], kv_shape: KVTensors,
                 delay_layer: int | None = None, delay_s: float = 0.0,
                 fail_layer: int | None = None) -> None:
        k = kv_shape
        self.num_layers = k.num_layers
        self.blocks = {
            b.block_key: torch.frombuffer(bytearray(b.data), dtype=torch.uint8).view(k.dtype)
            .view(k.num_layers, 2, k.num_kv_heads, 1, k.block_size, k.head_dim)
            for b in blocks}
        self.delay_layer, self.delay_s, self.fail_layer = delay_layer, delay_s, fail_layer
        self.transfer_done_s: dict[int, float] = {}
        self.written_block_ids: list[int] = []
        self.num_loaded_tokens = 0
        self._events: list[threading.Event] = []
        self._failed: set[int] = set()
        self._thread: threading.Thread | None = None
        self._loads: tuple = ()

    def get_num_matched_tokens(self, req, num_local_computed_tokens: int) -> int:
        bs = req.namespace.block_size
        n = 0
        for key in req.block_keys[num_local_computed_tokens // bs:]:
            if key not in self.blocks:
                break
            n += 1
        return n * bs

    def start_step(self, ctx: StepContext, kv: KVTensors) -> None:
        self._events = [threading.Event() for _ in range(self.num_layers)]
        self._failed = set()
        self._loads = ctx.loads
        if not ctx.loads:
            for e in self._events:
                e.set()
            return
        self._thread = threading.Thread(target=self._load, args=(ctx.loads, kv), daemon=True)
        self._thread.start()

    def _load(self, loads, kv: KVTensors) -> None:
        for layer in range(self.num_layers):
            if layer == self.delay_layer:
                time.sleep(self.delay_s)
            if layer == self.fail_layer:
                self._failed.add(layer)
                self._events[layer].set()
                continue
            for ld in loads:
                data = torch.cat([self.blocks[k][layer] for k in ld.block_keys], dim=2)
                kv.import_layer(layer, ld.block_ids, data)
                if layer == 0:
                    self.written_block_ids.extend(ld.block_ids)
                    self.num_loaded_tokens += ld.num_tokens
            self.transfer_done_s[layer] = time.monotonic()
            self._events[layer].set()

    def before_layer(self, layer: int, ctx: StepContext, kv: KVTensors) -> None:
        if not self._events[layer].wait(timeout=10.0):
            raise KVLoadError(f"layer {layer} KV did not arrive within 10 s",
                              tuple(ld.request_id for ld in self._loads))
        if layer in self._failed:
            raise KVLoadError(f"layer {layer} KV transfer failed",
                              tuple(ld.request_id for ld in self._loads))

    def end_step(self, ctx: StepContext, kv: KVTensors) -> None:
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None
