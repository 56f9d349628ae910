"""``DecodeLayers``: the decode step's layers in one C call each (kernels_decode.c)."""

from __future__ import annotations

import torch

DECODE_ROWS_MAX = 8
"""Sequences a ``DecodeLayers`` step takes at most (the scratch is sized for this many)."""

CACHED_WEIGHTS_BYTES = 32 << 20
"""Decode weights (layers + LM head) up to this size take ``DECODE_ROWS_MAX`` rows per
C step on any build; larger ones see ``decode_rows_max``."""


def decode_rows_max(weight_bytes: int, row_tile: int, threads: int, lanes: int) -> int:
    """Most sequences a pure decode step of a model with ``weight_bytes`` of decode weights
    runs through ``DecodeLayers`` (more go to the batched oneDNN GEMM path, which also
    takes the LM head from there on: ``LlamaForCausalLM.compute_logits``). ``row_tile``:
    input rows the kernels' GEMV reads each weight vector once for
    (``pmk_gemv_row_tile``: 4 on AVX-512, 1 elsewhere); ``threads``: torch's intra-op
    threads (oneDNN uses them all, the C rows one); ``lanes``: floats per vector of the
    hand-written SIMD GEMV (``pmk_gemv_lanes``: 16 on AVX-512, 8 on AVX2 + FMA, 1 where
    there is none).

    - Cache-resident weights (<= ``CACHED_WEIGHTS_BYTES``): ``DECODE_ROWS_MAX``. The tiny
      model's (11 MB) C rows beat oneDNN's GEMM at every batch from 2 to 8 (0.54 against
      0.96 ms at 2, 1.47 against 1.84 at 8; docs/benchmarks.md, "Decode batches").
    - Memory-bound weights with the 4-row tile: ``DECODE_ROWS_MAX`` on one thread, 4 on
      more. SmolLM2-135M (540 MB), wall ms a step, C rows against oneDNN (issue 16 session
      38, after the GEMVs began prefetching their weights and serving every 4-row group
      from each weight tile): one thread 32.6 / 39.7 at 4 rows, 31.0 / 42.5 at 5, 41.4 /
      54.6 at 8; two threads 28.1 / 30.6 at 4, 32.9 / 30.6 at 5, 42.7 / 37.0 at 8.
    - AVX2 + FMA (no row tile, 8 lanes): 4 on one thread, 2 on more. Each row reads the
      weights again, but from the tile (``GEMV_TILE_FLOATS``, 32768 floats = 128 KiB,
      kernels_decode.c) that the first row brought into L2, so the DRAM stream is paid
      once. SmolLM2 on a Zen 3 guest (AVX2; issue 16 session 39,
      ``docs/data/issue16_s38/smol3.py``, one process alternating the two paths; raw
      output ``docs/data/issue16_s39/smol_avx2.txt``), CPU ms of one thread a step, C rows
      / oneDNN, medians: at 3 rows 70.1 / 99.7 (6 rounds) and 56.0 / 63.3 (8 rounds, C
      lower in 8 of 8 pairs); at 4 rows 66.4 / 90.9 and 60.7 / 68.4 (C lower in 6 of 8);
      one run of 6 rounds each at 5, 6 and 8 rows: 74.2 / 80.1, 78.7 / 81.1, 105.9 /
      91.5. Only the ratios within a run count: the host moved the levels between runs.
      4, not 6: the 5- and 6-row margins (7 % and 3 %) lie inside that run's spread of
      rounds. On two threads oneDNN won at 3 and 4 rows (wall 55.7 / 41.6 and 55.3 / 41.7
      ms, 4 rounds).
    - No hand-written SIMD GEMV (1 lane: ``gemv_finish``'s compiler-vectorised loop only,
      no prefetch): 2, the cap session 18 set on an AVX-512 build before the prefetch;
      plain-C rows have never been measured against oneDNN."""
    if weight_bytes <= CACHED_WEIGHTS_BYTES:
        return DECODE_ROWS_MAX
    if row_tile >= 4:
        return DECODE_ROWS_MAX if threads <= 1 else 4
    return 4 if threads <= 1 and lanes >= 8 else 2


class DecodeLayers:
    """Decode layers for 1 to ``DECODE_ROWS_MAX`` one-token sequences, one C call each
    (``pmk_decode_layer_f32`` for one sequence, ``pmk_decode_layer_rows_f32`` for more,
    kernels_decode.c): the layers' weight addresses and sizes are laid out once in an int64
    plan, and a step passes each sequence's position, slot, block table and the RoPE tables
    in ``set_step``. Same kernels in the same order as the per-call one-row path of
    ``model/fused.py``, so the same floats; with several sequences each weight tile is read
    once for all of them and every sequence still gets the floats it gets alone
    (batch-invariant).

    ``layers``: the model's decoder layers (float32 contiguous weights, biases only on
    qkv); ``kv_caches``: one contiguous float32 ``[2, kv_heads, blocks, block_size, D]``
    cache per layer; ``extra_weight_bytes``: other weights a decode step streams (the LM
    head), counted in ``max_rows``. Raises ``ValueError`` when a layer does not fit that
    layout."""

    def __init__(self, layers: list, kv_caches: list[torch.Tensor], eps: float,
                 extra_weight_bytes: int = 0) -> None:
        from pymooncake.engine.kernels import _need  # the package imports this module
        self._lib = _need()
        rows = []
        for layer, cache in zip(layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            ws = (layer.input_layernorm.weight, attn.qkv_proj.weight, attn.o_proj.weight,
                  layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
                  mlp.down_proj.weight, cache)
            qkv_b = attn.qkv_proj.bias
            if (any(t.dtype != torch.float32 or not t.is_contiguous() for t in ws)
                    or (qkv_b is not None and (qkv_b.dtype != torch.float32
                                               or not qkv_b.is_contiguous()))
                    or any(getattr(m, "bias", None) is not None
                           for m in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj))):
                raise ValueError("DecodeLayers: float32 contiguous weights and caches, "
                                 "biases only on qkv, needed")
            two, kvh, nb, bs, d = cache.shape
            hidden, inter = attn.o_proj.weight.shape[0], mlp.down_proj.weight.shape[1]
            rows.append([ws[0].data_ptr(), ws[1].data_ptr(),
                         0 if qkv_b is None else qkv_b.data_ptr(), ws[2].data_ptr(),
                         ws[3].data_ptr(), ws[4].data_ptr(), ws[5].data_ptr(),
                         cache.data_ptr(), hidden, attn.num_heads, kvh, d, inter, nb, bs])
        self.plan = torch.tensor(rows, dtype=torch.int64)
        self._row_bytes = self.plan.stride(0) * 8
        self._alive = (list(layers), list(kv_caches))  # the addresses in the plan
        self.key = tuple(c.data_ptr() for c in kv_caches)
        hidden, heads, kvh, d, inter = rows[0][8:13]
        self.scratch = torch.empty(DECODE_ROWS_MAX * (2 * hidden + (2 * heads + 2 * kvh) * d
                                                      + 3 * inter), dtype=torch.float32)
        self.step = torch.zeros(DECODE_ROWS_MAX, 6, dtype=torch.int64)
        self._step_rows = self.step.numpy()  # the same memory: a step's rows set in place
        self._block_size = int(rows[0][14])
        self.rows = 1
        self.eps = eps
        self.scales = [layer.self_attn.scale for layer in layers]
        self.weight_bytes = sum(t.numel() * t.element_size() for layer in layers
                                for t in (layer.self_attn.qkv_proj.weight,
                                          layer.self_attn.o_proj.weight,
                                          layer.mlp.gate_up_proj.weight,
                                          layer.mlp.down_proj.weight))
        """Bytes of the layers' GEMV weights (qkv, o, gate|up, down)."""
        self.max_rows = decode_rows_max(self.weight_bytes + extra_weight_bytes,
                                        self._lib.pmk_gemv_row_tile(),
                                        torch.get_num_threads(), self._lib.pmk_gemv_lanes())
        """Sequences a step runs here at most (``decode_rows_max`` of the layers' weights
        and ``extra_weight_bytes``: the model's LM head, ``model/fused.py``)."""

    def set_step(self, positions: list[int], slots: list[int], tables: torch.Tensor,
                 ctx_lens: list[int], cos_t: torch.Tensor, sin_t: torch.Tensor) -> None:
        """This step's ``m = len(positions)`` tokens (1 <= m <= ``DECODE_ROWS_MAX``), one
        per sequence: ``positions``, ``slots`` (block * block_size + offset) and
        ``ctx_lens`` (tokens, this one included) per sequence, ``tables`` ``[m, W]``
        contiguous int64 block ids, ``cos_t``/``sin_t`` the contiguous ``[P, D]`` RoPE
        tables (P > every position); the tensors must stay alive until the step's layers
        ran. Raises ``ValueError`` otherwise."""
        m = len(positions)
        if (not 1 <= m <= DECODE_ROWS_MAX or len(slots) != m or len(ctx_lens) != m
                or tables.dtype != torch.int64 or tables.dim() != 2 or tables.shape[0] < m
                or not tables.is_contiguous() or not cos_t.is_contiguous()
                or not sin_t.is_contiguous() or cos_t.dtype != torch.float32
                or sin_t.dtype != torch.float32 or max(positions) >= cos_t.shape[0]
                or tables.shape[1] * self._block_size < max(ctx_lens)):
            raise ValueError(f"DecodeLayers.set_step: 1..{DECODE_ROWS_MAX} sequences, an "
                             "int64 table row covering each ctx_len, float32 contiguous "
                             "RoPE tables covering the positions")
        base, stride = tables.data_ptr(), tables.stride(0) * 8
        c, s = cos_t.data_ptr(), sin_t.data_ptr()
        rows = self._step_rows
        for r in range(m):
            rows[r] = (positions[r], slots[r], base + r * stride, ctx_lens[r], c, s)
        self.rows = m

    def run(self, i: int, x: torch.Tensor) -> None:
        """Layer ``i`` on the residual ``x`` (``[m, hidden]`` float32 contiguous, m the
        step's sequences, updated in place). Raises ``RuntimeError`` if an attention
        scratch allocation fails."""
        plan = self.plan.data_ptr() + i * self._row_bytes
        if self.rows == 1:
            rc = self._lib.pmk_decode_layer_f32(plan, self.step.data_ptr(), self.eps,
                                                self.scales[i], x.data_ptr(),
                                                self.scratch.data_ptr())
        else:
            rc = self._lib.pmk_decode_layer_rows_f32(plan, self.step.data_ptr(), self.rows,
                                                     self.eps, self.scales[i], x.data_ptr(),
                                                     self.scratch.data_ptr())
        if rc != 0:
            raise RuntimeError("decode_layer: attention scratch allocation failed")
