"""DRAM offset allocator and SSD tier (pure / local files; no sockets)."""

from __future__ import annotations

import os
import random

import pytest

from pymooncake.store.tiers.dram_segment import DramSegment, OffsetAllocator
from pymooncake.store.tiers.ssd import SsdCorrupt, SsdFull, SsdTier

MiB = 1 << 20


def _check_free_ranges(alloc: OffsetAllocator) -> None:
    """The allocator's free-range maps agree with each other, with its bins and their bit
    mask, and are maximal: no free range touches another (``free`` merges neighbours)."""
    by_offset, by_end = alloc._free_by_offset, alloc._free_by_end
    assert by_end == {o + s: o for o, s in by_offset.items()}
    for o, s in by_offset.items():
        assert o + s not in by_offset, f"free ranges at {o} and {o + s} were not merged"
        assert o in alloc._bins[s.bit_length() - 1]
    assert sum(len(b) for b in alloc._bins) == len(by_offset)
    assert alloc._mask == sum(1 << i for i, b in enumerate(alloc._bins) if b)
    assert alloc.free_bytes == sum(by_offset.values())


def test_allocator_matches_interval_model_under_random_ops() -> None:
    """Random allocate/free against a brute-force model: no overlaps, exact accounting,
    and an allocation fails only when no gap in the model is large enough."""
    rng = random.Random(7)
    cap = 1 << 16
    alloc = OffsetAllocator(cap, alignment=64)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            assert alloc.free(off) == live.pop(off)
        else:
            size = rng.choice([1, 63, 64, 65, 500, 4096, 5000, 20000])
            off = alloc.allocate(size)
            rounded = (size + 63) // 64 * 64
            # model: sorted gaps
            spans = sorted(live.items())
            gaps, pos = [], 0
            for o, s in spans:
                gaps.append(o - pos)
                pos = o + s
            gaps.append(cap - pos)
            if off is None:
                assert max(gaps) < rounded
            else:
                assert off % 64 == 0 and off + rounded <= cap
                for o, s in spans:
                    assert off + rounded <= o or o + s <= off
                live[off] = rounded
        assert alloc.used_bytes == sum(live.values())
        _check_free_ranges(alloc)
    for off in list(live):
        alloc.free(off)
        _check_free_ranges(alloc)
    assert alloc.free_bytes == cap and alloc.largest_free_bytes() == cap
    assert alloc.fragmentation() == 0.0


def test_allocator_fragmentation_metric() -> None:
    alloc = OffsetAllocator(1024, alignment=64)
    offs = [alloc.allocate(64) for _ in range(16)]
    assert alloc.allocate(1) is None
    for o in offs[::2]:
        alloc.free(o)  # 8 holes of 64 bytes: free 512, largest 64
    assert alloc.fragmentation() == pytest.approx(1 - 64 / 512)
    assert alloc.allocate(128) is None
    alloc.free(offs[1])  # merges holes 0,1,2 → 192 bytes
    assert alloc.largest_free_bytes() == 192
    with pytest.raises(ValueError):
        alloc.allocate(0)
    with pytest.raises(KeyError):
        alloc.free(offs[1])


def test_dram_segment_bounds() -> None:
    seg = DramSegment(4096)
    seg.write_at(100, b"abc")
    assert seg.read_at(100, 3) == b"abc"
    with pytest.raises(ValueError):
        seg.read_at(4095, 2)


def test_bug_26_ssd_tier_evicts_lru_by_default(tmp_path) -> None:
    tier = SsdTier(tmp_path, 10 * MiB)
    values = {f"k{i}": bytes([i]) * MiB for i in range(30)}
    for k, v in values.items():
        tier.put(k, v)
        assert tier.used_bytes <= 10 * MiB
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.obj"))
    assert on_disk <= 10 * MiB + 10 * 4096  # object bytes plus a small header per file
    for i in range(20):
        assert tier.get(f"k{i}") is None
    for i in range(20, 30):
        assert tier.get(f"k{i}") == values[f"k{i}"]


def test_bug_26_no_eviction_policy_refuses_without_partial_file(tmp_path) -> None:
    tier = SsdTier(tmp_path, 3 * MiB, eviction_policy="none")
    for i in range(3):
        tier.put(f"k{i}", b"x" * MiB)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SsdFull):
        tier.put("k3", b"y" * MiB)
    assert sorted(os.listdir(tmp_path)) == before
    assert tier.get("k3") is None and tier.get("k0") == b"x" * MiB


def test_ssd_truncated_file_is_a_miss_not_partial(tmp_path) -> None:
    tier = SsdTier(tmp_path, MiB)
    tier.put("a", b"z" * 1000)
    (f,) = list(tmp_path.glob("*.obj"))
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(SsdCorrupt):  # an error, never the partial bytes
        tier.get("a")
    assert tier.get("a") is None
    assert "a" not in tier
