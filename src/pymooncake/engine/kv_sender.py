"""P→D KV transfer, sending side: write a request's prompt KV blocks from the prefill
engine's paged cache into a decode worker's receive buffer with the Transfer Engine.

Zero copy on this side: the whole paged KV tensor (``KVTensors.buffer``) is registered with
the Transfer Engine once, and every (layer, K/V, KV head) run of a block is one WRITE
request straight from it (``KVTensors.block_regions``). The receive buffer holds the blocks
in order, each ``block_nbytes`` bytes laid out ``[layer, K/V, kv_head, block_size,
head_dim]`` (the ``export_block_bytes`` layout), so the decode side imports it per layer.

Mooncake FAST'25 §3.1 step 3 ships each layer as it finishes; ``send_layers`` takes the
layers to send so a per-layer hook can call it after each layer (see docs/serving.md for
what the workers do today).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pymooncake.rpc.messages import KVTarget

if TYPE_CHECKING:
    from pymooncake.engine.kv.kv_tensors import KVTensors
    from pymooncake.transfer import TransferEngine


class KVTransferError(RuntimeError):
    """A P→D write failed (peer gone, range refused); the request cannot be decoded."""


class KVSender:
    """Writes paged-KV blocks to remote receive buffers. Registers ``kv.buffer`` at init."""

    def __init__(self, engine: TransferEngine, kv: KVTensors) -> None:
        self.engine = engine
        self.kv = kv
        self.base_addr = engine.register_memory(kv.buffer)
        self.bytes_sent = 0

    def requests(self, block_ids: Sequence[int], target: KVTarget,
                 layers: Sequence[int] | None = None) -> list:
        """The WRITE requests moving ``block_ids`` (in prompt order) into ``target``."""
        from pymooncake.transfer import TransferOp, TransferRequest

        kv = self.kv
        if target.block_nbytes != kv.block_nbytes:
            raise KVTransferError(f"receive buffer block size {target.block_nbytes} B != this "
                                  f"engine's {kv.block_nbytes} B (different model or layout)")
        if len(block_ids) > target.num_blocks:
            raise KVTransferError(f"{len(block_ids)} blocks do not fit the receive buffer of "
                                  f"{target.num_blocks}")
        run = kv.block_size * kv.head_dim * kv.buffer.element_size()
        out = []
        for j, block_id in enumerate(block_ids):
            for layer in (range(kv.num_layers) if layers is None else layers):
                for kind in (0, 1):
                    for h, (off, length) in enumerate(kv.block_regions(layer, kind, block_id)):
                        dst = (j * kv.block_nbytes
                               + ((layer * 2 + kind) * kv.num_kv_heads + h) * run)
                        out.append(TransferRequest(TransferOp.WRITE, self.base_addr + off,
                                                   target.segment, target.addr + dst, length))
        return out

    def send(self, block_ids: Sequence[int], target: KVTarget,
             layers: Sequence[int] | None = None, timeout_s: float = 30.0) -> int:
        """Write the blocks and wait; returns bytes written. Raises ``KVTransferError``
        naming the first failure (nothing partial is reported as success)."""
        reqs = self.requests(block_ids, target, layers)
        if not reqs:
            return 0
        statuses = self.engine.batch_transfer_sync(reqs, timeout_s=timeout_s)
        for st in statuses:
            if not st.ok:
                raise KVTransferError(f"KV write to {target.segment} failed: "
                                      f"{getattr(st.code, 'value', st.code)}: {st.reason}")
        n = sum(r.length for r in reqs)
        self.bytes_sent += n
        return n
