"""P→D KV transfer, sending side: write a request's prompt KV blocks from the prefill
engine's paged cache into a decode worker's receive buffer with the Transfer Engine.

Zero copy on this side: the whole paged KV tensor (``KVTensors.buffer``, head-major
``[layer, K/V, kv_head, block, block_size, head_dim]``) is registered with the Transfer
Engine once, and WRITE requests go straight from it. The receive buffer of a request with
``N`` blocks is laid out the same way, ``[layer, K/V, kv_head, N, block_size, head_dim]``,
so a run of consecutive block ids is one request per (layer, K/V, KV head), and the
decode side imports one layer as one slice.

Mooncake FAST'25 §3.1 step 3 ships each layer as it finishes:
``kv_layerwise.LayerwiseKVSender`` is the prefill engine's per-layer hook doing that with
a ``KVSender``; ``KVSender.send`` moves whole blocks at once (all layers). The prompt's
partial last block goes too, whole (its slots past the prompt's end are not meaningful;
the decode side knows the prompt's length): the decode worker then has every prompt
token's KV and computes only the first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pymooncake.engine.kv_writes import KV_WRITE_TIMEOUT_S, KVWrites
from pymooncake.rpc.messages import KVTarget

if TYPE_CHECKING:
    from pymooncake.engine.kv.kv_tensors import KVTensors
    from pymooncake.transfer import TransferEngine


class KVTransferError(RuntimeError):
    """A P→D write failed (peer gone, range refused); the request cannot be decoded."""


class KVSender:
    """Writes paged-KV blocks to remote receive buffers. Registers ``kv.buffer`` at init.

    ``writes`` (``kv_writes.KVWrites``) bounds every wait for a write and gives up the
    writes of a request aborted meanwhile (``cancel``, from any thread)."""

    def __init__(self, engine: TransferEngine, kv: KVTensors) -> None:
        self.engine = engine
        self.kv = kv
        self.base_addr = engine.register_memory(kv.buffer)
        self.bytes_sent = 0
        self.writes = KVWrites(engine)

    def cancel(self, request_id: str) -> None:
        """Any thread: give up ``request_id``'s KV writes now (it was aborted)."""
        self.writes.cancel(request_id)

    def requests(self, block_ids: Sequence[int], target: KVTarget,
                 layers: Sequence[int] | None = None, first_block: int = 0) -> list:
        """The WRITE requests moving ``block_ids`` (prompt blocks ``first_block``,
        ``first_block + 1``, … in order) into ``target``. Runs of consecutive block ids are
        one request per (layer, K/V, KV head): both ends are contiguous there."""
        from pymooncake.transfer import TransferOp, TransferRequest

        kv = self.kv
        if target.block_nbytes != kv.block_nbytes:
            raise KVTransferError(f"receive buffer block size {target.block_nbytes} B != this "
                                  f"engine's {kv.block_nbytes} B (different model or layout)")
        if first_block < 0 or first_block + len(block_ids) > target.num_blocks:
            raise KVTransferError(f"blocks [{first_block}, {first_block + len(block_ids)}) do "
                                  f"not fit the receive buffer of {target.num_blocks}")
        run = kv.run_nbytes
        runs = []                     # (first block id, its position in the prompt, length)
        pos = first_block
        for block_id, n in _runs(block_ids):
            runs.append((block_id, pos, n))
            pos += n
        src_stride = kv.num_blocks * run
        dst_stride = target.num_blocks * run
        out = []
        for layer in (range(kv.num_layers) if layers is None else layers):
            for plane in range(layer * 2 * kv.num_kv_heads, (layer + 1) * 2 * kv.num_kv_heads):
                for block_id, pos, n in runs:
                    out.append(TransferRequest(
                        TransferOp.WRITE, self.base_addr + plane * src_stride + block_id * run,
                        target.segment, target.addr + plane * dst_stride + pos * run, n * run))
        return out

    def digest(self, block_ids: Sequence[int]) -> int:
        """XXH3-64 of the bytes ``block_ids`` (prompt blocks 0, 1, … in order) occupy in a
        receive buffer: per (layer, K/V, KV head) plane, their ``block_size x head_dim``
        runs one after the other — the order ``KVReceiver.digest`` reads the buffer in
        (``kv_receiver``). Reads the paged cache, no copy; the decode side verifies the
        blocks it got against it before decoding from them."""
        import xxhash

        kv = self.kv
        run = kv.run_nbytes
        flat = kv.buffer.view(-1).view(torch.uint8).numpy()
        runs = _runs(block_ids)
        h = xxhash.xxh3_64()
        for plane in range(kv.num_planes):
            base = plane * kv.num_blocks * run
            for block_id, n in runs:
                h.update(flat[base + block_id * run:base + (block_id + n) * run])
        return h.intdigest()

    def send(self, block_ids: Sequence[int], target: KVTarget,
             layers: Sequence[int] | None = None, timeout_s: float = KV_WRITE_TIMEOUT_S,
             request_id: str | None = None) -> int:
        """Write the blocks and wait; returns bytes written. Raises ``KVTransferError``
        naming the first failure (nothing partial is reported as success), and when the
        write is not done in ``timeout_s`` or ``request_id`` is cancelled meanwhile."""
        reqs = self.requests(block_ids, target, layers)
        if not reqs:
            return 0
        if request_id is None:
            statuses = self.engine.batch_transfer_sync(reqs, timeout_s=timeout_s)
        else:
            bid = self.engine.allocate_batch(len(reqs))
            self.engine.submit(bid, reqs)
            done, why = self.writes.wait_for(bid, (request_id,), timeout_s)
            if done is None:
                raise KVTransferError(f"KV write to {target.segment}: {why}")
            statuses = done
        for st in statuses:
            if not st.ok:
                raise KVTransferError(f"KV write to {target.segment} failed: "
                                      f"{getattr(st.code, 'value', st.code)}: {st.reason}")
        n = sum(r.length for r in reqs)
        self.bytes_sent += n
        return n


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``block_ids`` as runs of consecutive ids: (first id, length)."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs
