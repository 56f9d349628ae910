"""The prefill worker's Store staging buffer: 2k tokens of KV at least, up to 8k tokens
within 32 MiB (``engine.worker.config.staging_blocks``; hand-computed sizes)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


def test_staging_holds_a_burst_of_small_blocks_and_2k_tokens_of_large_ones():
    from pymooncake.engine.worker.config import staging_blocks

    tiny = 16 * 4 * 2 * 2 * 32 * 4          # 16 tokens x 4 layers x K/V x 2 heads x 32 x fp32
    assert tiny == 32 * 1024
    assert staging_blocks(16, tiny) == 512          # 8192 tokens: 16 MiB < 32 MiB
    smollm2 = 16 * 30 * 2 * 3 * 64 * 4      # 30 layers, 3 KV heads, head_dim 64, fp32
    assert staging_blocks(16, smollm2) == 128       # 2048 tokens (92 MiB: over 32 MiB)
    assert staging_blocks(16, 64 << 10) == 512      # 32 MiB / 64 KiB = 512 = 8192 tokens
    assert staging_blocks(16, 96 << 10) == 341      # floor(32 MiB / 96 KiB), between the bounds
    assert staging_blocks(256, 1 << 20) == 64       # at least 64 blocks
