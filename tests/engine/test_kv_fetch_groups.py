"""Layer groups of a layer-wise Store load, cut at checksum-chunk boundaries
(``kv_fetch.chunk_groups``): every byte of a block is read once, in whole chunks."""

from __future__ import annotations

from pymooncake.engine.kv_fetch import chunk_groups, layer_groups
from pymooncake.store.checksum import CHUNK


def test_smollm2_groups_read_each_chunk_once() -> None:
    # SmolLM2-135M float32: 30 layers of 24,576 B, a 737,280 B block (11.25 chunks)
    lb, nb = 24_576, 737_280
    got = chunk_groups(layer_groups(30), lb, nb)
    assert got == [(0, 1, 65_536), (1, 3, 131_072), (3, 7, 196_608), (7, 15, 393_216),
                   (15, 23, 589_824), (23, 30, nb)]
    for _, b, end in got:  # a group's chunks cover its layers
        assert b * lb <= end and (end % CHUNK == 0 or end == nb)


def test_tiny_block_of_one_chunk_is_one_group() -> None:
    # the tiny model: 4 layers of 8 KiB, a 32 KiB block (less than one chunk)
    assert chunk_groups(layer_groups(4), 8192, 32_768) == [(0, 4, 32_768)]


def test_groups_already_covered_merge_into_the_previous_one() -> None:
    # 1 KiB layers: layer 0's chunk covers layers 0-63, so the groups ending by layer 63
    # merge into group 0; (63, 71) needs the second chunk, which then covers the rest
    got = chunk_groups(layer_groups(100), 1024, 102_400)
    assert got == [(0, 63, 65_536), (63, 100, 102_400)]
