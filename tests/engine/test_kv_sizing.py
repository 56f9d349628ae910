"""``engine.config.size_kv``: every KV buffer sized from the model's KV bytes per token
(issue 14 item 8), checked against hand calculations."""

from __future__ import annotations

import pytest

from pymooncake.engine.config import KVSizing, kv_bytes_per_token, size_kv
from pymooncake.engine.worker.base import WorkerConfig, model_kv_bytes_per_token, worker_sizing

SMOLLM2 = kv_bytes_per_token(num_layers=30, num_kv_heads=3, head_dim=64, elem_bytes=4)


def test_kv_bytes_per_token_by_hand() -> None:
    assert SMOLLM2 == 30 * 2 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(4, 2, 32, 4) == 2_048                      # tiny, float32
    assert model_kv_bytes_per_token("tiny", "float32") == 2_048
    assert model_kv_bytes_per_token("tiny", "bfloat16") == 1_024


def test_defaults_for_smollm2_by_hand() -> None:
    s = size_kv(SMOLLM2, 16, 8192)
    block = 46_080 * 16                                                   # 737,280 B
    assert s.block_nbytes == block
    assert s.num_kv_blocks == 16384 // 16 == 1024                          # default tokens
    assert s.kv_cache_bytes == 1024 * block == 754_974_720                # 720 MiB
    # receive arena: max(one 8192-token prompt = 512 blocks, half the cache = 512 blocks)
    assert s.recv_buffer_bytes == 512 * block == 377_487_360
    # the largest prompt of the 50-request replay (2,724 tokens, 170 blocks) fits
    assert 170 * block <= s.recv_buffer_bytes
    assert s.global_segment_size_bytes == 2 * 1024 * block == 1_509_949_440
    assert "46080 B/token" in s.describe("decode") and "360 MiB" in s.describe("decode")


def test_budget_and_explicit_values() -> None:
    block = SMOLLM2 * 16
    s = size_kv(SMOLLM2, 16, 8192, kv_memory_bytes=1 << 30)
    assert s.num_kv_blocks == (1 << 30) // block == 1456
    assert s.recv_buffer_bytes == 728 * block                              # half the cache
    small = size_kv(SMOLLM2, 16, 4096, kv_memory_bytes=100 * block)
    assert small.num_kv_blocks == 100 and small.recv_buffer_bytes == 100 * block  # <= cache
    long = size_kv(2_048, 16, 32768)                                      # max_model_len wins
    assert long.num_kv_blocks == 2048 and long.recv_buffer_bytes == 2048 * 2_048 * 16
    x = size_kv(SMOLLM2, 16, 8192, num_kv_blocks=10, recv_buffer_bytes=5,
                global_segment_size_bytes=7)
    assert x == KVSizing(SMOLLM2, 16, 10, 5, 7)
    with pytest.raises(ValueError, match="kv_memory_bytes .* holds no KV block"):
        size_kv(SMOLLM2, 16, 8192, kv_memory_bytes=block - 1)
    with pytest.raises(ValueError, match="recv_buffer_bytes must be > 0"):
        size_kv(SMOLLM2, 16, 8192, recv_buffer_bytes=0)


def test_worker_config_sizes_from_the_model() -> None:
    c = WorkerConfig("d", "decode", "127.0.0.1:1")
    assert c.num_kv_blocks is None and c.recv_buffer_bytes is None
    s = worker_sizing(c, SMOLLM2, 1024)
    assert s.recv_buffer_bytes == 377_487_360
    with pytest.raises(ValueError, match="recv_buffer_bytes must be > 0"):
        WorkerConfig("d", "decode", "127.0.0.1:1", recv_buffer_bytes=0)
