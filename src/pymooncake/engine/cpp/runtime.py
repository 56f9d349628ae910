"""A CPP stage's compute core: its layers' paged KV cache and the chunks of each prompt.

No sockets, threads or clocks here (``engine.cpp.stage`` is the process around it). A
request's blocks are allocated at its first chunk for the whole prompt; chunk ``k`` writes
its K/V there and attends to the K/V earlier chunks left in this stage's cache (the same
``AttentionMetadata`` the ``ModelRunner`` builds for a chunked prefill, so attention runs
the same kernels). ``export_kv`` hands out a request's blocks of this stage's layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pymooncake.engine import kernels
from pymooncake.engine.cpp.model import StageModel
from pymooncake.engine.kv.kv_tensors import KVTensors
from pymooncake.engine.model.attention import AttentionMetadata, PrefillSeq


def chunk_bounds(num_tokens: int, chunk_tokens: int,
                 edge_tokens: int = 0) -> list[tuple[int, int]]:
    """``(start, length)`` of each chunk of a ``num_tokens`` prompt: ``chunk_tokens`` each
    (the last may be shorter). With ``edge_tokens`` (0 < edge < chunk) and a prompt longer
    than two chunks, the first chunk and the last ``chunk_tokens`` tokens go in chunks of
    ``edge_tokens``: the pipeline's fill (stage 0 alone) and drain (the last stage alone, on
    the dearest chunk) shrink. ``conductor.policy.cpp.chunk_sizes`` is the same plan."""
    if num_tokens <= 0 or chunk_tokens <= 0:
        raise ValueError(f"need num_tokens > 0 and chunk_tokens > 0, got {num_tokens}, "
                         f"{chunk_tokens}")
    if not 0 < edge_tokens < chunk_tokens or num_tokens <= 2 * chunk_tokens:
        return [(s, min(chunk_tokens, num_tokens - s))
                for s in range(0, num_tokens, chunk_tokens)]
    tail = num_tokens - chunk_tokens
    out = [(0, edge_tokens)]
    out += [(s, min(chunk_tokens, tail - s)) for s in range(edge_tokens, tail, chunk_tokens)]
    out += [(s, min(edge_tokens, num_tokens - s)) for s in range(tail, num_tokens, edge_tokens)]
    return out


def chunk_metadata(block_ids: list[int], start: int, n: int, block_size: int,
                   use_kernels: bool) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions ``[n]`` and attention metadata of one prefill chunk ``[start, start + n)``
    of a sequence whose blocks are ``block_ids`` (``ModelRunner.prepare``'s prefill rows)."""
    bs = block_size
    positions = torch.arange(start, start + n, dtype=torch.int64)
    bids = torch.as_tensor(block_ids, dtype=torch.int64)
    slots = bids[positions // bs] * bs + positions % bs
    ctx = start + n
    if use_kernels:  # the C kernel reads the context in place
        seq = PrefillSeq(0, n, ctx, None, None, bids[:-(-ctx // bs)].clone())
    elif start == 0:
        seq = PrefillSeq(0, n, n, None, None)
    else:
        mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
        seq = PrefillSeq(0, n, ctx, bids[:-(-ctx // bs)].clone(), mask)
    return positions, AttentionMetadata(slots, [seq])


@dataclass(slots=True)
class _Seq:
    num_tokens: int
    block_ids: list[int]
    done_tokens: int = 0
    chunk_s: list[float] = field(default_factory=list)


class StageRuntime:
    """Runs chunks of prompts through one ``StageModel`` over its own ``KVTensors``.

    Chunks of a request must arrive in order (``start`` = tokens already done). Raises
    ``ValueError`` for an out-of-order chunk, an unknown request or a full cache.
    """

    def __init__(self, model: StageModel, num_blocks: int, block_size: int = 16) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.kv = KVTensors(model.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                            cfg.head_dim, model.dtype)
        self.use_kernels = self.kv.dtype == torch.float32 and kernels.available()
        self._free = list(range(num_blocks - 1, -1, -1))
        self.seqs: dict[str, _Seq] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def _begin(self, rid: str, num_tokens: int) -> _Seq:
        need = -(-num_tokens // self.block_size)
        if need > len(self._free):
            raise ValueError(f"request {rid}: {num_tokens} tokens need {need} KV blocks, "
                             f"{len(self._free)} free")
        seq = _Seq(num_tokens, [self._free.pop() for _ in range(need)])
        self.seqs[rid] = seq
        return seq

    def run_chunk(self, rid: str, start: int, num_tokens: int,
                  x: torch.Tensor) -> torch.Tensor:
        """Run chunk ``[start, start + len(x))`` of request ``rid`` (``num_tokens`` in its
        whole prompt). ``x``: token ids ``[n]`` int64 on the first stage, else the residual
        stream ``[n, hidden]``. Returns what the next stage needs (or, on the last stage,
        final hidden states)."""
        seq = self.seqs.get(rid)
        if seq is None:
            if start != 0:
                raise ValueError(f"request {rid}: first chunk starts at {start}, not 0")
            seq = self._begin(rid, num_tokens)
        n = x.shape[0]
        if start != seq.done_tokens or start + n > seq.num_tokens or n == 0:
            raise ValueError(f"request {rid}: chunk [{start}, {start + n}) does not follow "
                             f"{seq.done_tokens} of {seq.num_tokens} tokens")
        positions, meta = chunk_metadata(seq.block_ids, start, n, self.block_size,
                                         self.use_kernels)
        if x.dtype == torch.int64:
            x = self.model.embed(x)
        out = self.model.forward(x, positions, meta, self.kv.layer_caches)
        seq.done_tokens += n
        return out

    def first_token(self, hidden_last_row: torch.Tensor) -> int:
        """Greedy token of the final hidden row ``[1, hidden]`` (last stage only)."""
        return int(torch.argmax(self.model.logits(hidden_last_row), dim=-1)[0])

    def export_kv(self, rid: str, layer: int) -> torch.Tensor:
        """``[2, kv_heads, num_blocks, block_size, head_dim]`` of the request's blocks in
        this stage's local ``layer`` (0-based: absolute layer ``model.start + layer``).
        Tokens past the prompt in its last block are zeros or stale."""
        seq = self.seqs.get(rid)
        if seq is None:
            raise ValueError(f"unknown request {rid!r}")
        if not 0 <= layer < self.model.num_layers:
            raise ValueError(f"layer {layer} not in [0, {self.model.num_layers})")
        return self.kv.export_layer(layer, seq.block_ids)

    def release(self, rid: str) -> bool:
        """Free the request's blocks; ``False`` if it was unknown."""
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return False
        self._free.extend(reversed(seq.block_ids))
        return True
