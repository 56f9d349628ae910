"""Per-layer K/V tensors of the paged cache, and block ↔ (buffer, offset, length) for transfer.

One contiguous buffer ``[num_layers, 2, kv_heads, num_blocks, block_size, head_dim]`` (the
``KV_LAYOUT`` named in the namespace's layout descriptor). Head-major per layer, so that
gathering a batch's blocks yields ``[kv_heads, batch, context, head_dim]`` attention operands
with no transpose copy (4x cheaper decode attention on CPU than block-major); a block of one
layer's K or V is ``kv_heads`` contiguous ``[block_size, head_dim]`` runs. Export/import move whole
blocks of one layer (or all layers) as contiguous host tensors: what the Store and the
Transfer Engine carry.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KV_LAYOUT = "paged_l2hnbd"
"""Layout name: layer, K/V, kv head, block, token in block, head dim (outer to inner)."""

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


class KVTensors:
    """The paged KV cache memory."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.buffer = torch.zeros(num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim,
                                  dtype=dtype)
        self.layer_caches = [self.buffer[i] for i in range(num_layers)]
        """Per layer ``[2, kv_heads, num_blocks, block_size, head_dim]`` views (K, V)."""

    @property
    def run_nbytes(self) -> int:
        """Bytes of one block's run in one (layer, K/V, KV head) plane:
        ``block_size x head_dim`` elements, contiguous."""
        return self.block_size * self.head_dim * self.buffer.element_size()

    @property
    def num_planes(self) -> int:
        """(layer, K/V, KV head) planes: ``num_layers x 2 x num_kv_heads``."""
        return self.num_layers * 2 * self.num_kv_heads

    @property
    def block_nbytes_per_layer(self) -> int:
        """Bytes of one block's K plus V in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.buffer.element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers (one exported block)."""
        return self.num_layers * self.block_nbytes_per_layer

    def block_regions(self, layer: int, kind: int, block_id: int) -> list[tuple[int, int]]:
        """(byte offset in ``buffer``, length in bytes) of each KV head's run of block
        ``block_id``'s K (kind 0) or V (kind 1) in ``layer``: where a transfer reads or
        writes it (one region per KV head)."""
        run = self.run_nbytes
        out = []
        for h in range(self.num_kv_heads):
            index = ((layer * 2 + kind) * self.num_kv_heads + h) * self.num_blocks + block_id
            out.append((index * run, run))
        return out

    def export_layer(self, layer: int, block_ids: Sequence[int]) -> torch.Tensor:
        """``[2, kv_heads, n, block_size, head_dim]`` contiguous copy of blocks in a layer."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.int64)
        return self.buffer[layer].index_select(2, idx).contiguous()

    def import_layer(self, layer: int, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` (as from ``export_layer``) into blocks of ``layer``.

        Raises ``ValueError`` on a shape or dtype mismatch.
        """
        expect = (2, self.num_kv_heads, len(block_ids), self.block_size, self.head_dim)
        if tuple(data.shape) != expect or data.dtype != self.dtype:
            raise ValueError(f"layer {layer} import: got {tuple(data.shape)} {data.dtype}, "
                             f"expected {expect} {self.dtype}")
        idx = torch.as_tensor(list(block_ids), dtype=torch.int64)
        self.buffer[layer].index_copy_(2, idx, data)

    def export_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``[num_layers, 2, kv_heads, n, block_size, head_dim]`` contiguous host copy."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.int64)
        return self.buffer.index_select(3, idx).contiguous()

    def export_block_bytes(self, block_id: int) -> bytes:
        """One block, all layers, as ``block_nbytes`` raw bytes (layer, K/V, head, token)."""
        return self.export_blocks([block_id]).view(torch.uint8).numpy().tobytes()

    def import_block_bytes(self, block_id: int, data: bytes) -> None:
        """Inverse of ``export_block_bytes``. Raises ``ValueError`` on a wrong length."""
        if len(data) != self.block_nbytes:
            raise ValueError(f"block import: got {len(data)} bytes, expected {self.block_nbytes}")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype)
        t = raw.view(self.num_layers, 2, self.num_kv_heads, 1, self.block_size, self.head_dim)
        self.buffer[:, :, :, block_id:block_id + 1].copy_(t)

    def block_checksum(self, block_id: int) -> str:
        """BLAKE3 hex digest of a block's bytes (tests compare before/after: BUG-10)."""
        import blake3
        return blake3.blake3(self.export_block_bytes(block_id)).hexdigest()
