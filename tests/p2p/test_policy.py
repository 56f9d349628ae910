"""Pure parts of the P2P Store: manifests, holder records, keys, the shard/holder choice."""

from __future__ import annotations

import random

import blake3
import pytest

from pymooncake.p2p.manifest import (
    Entry,
    Holder,
    Manifest,
    build_manifest,
    check_name,
    cut_shards,
    holder_key,
    holders_prefix,
    manifest_key,
    name_from_manifest_key,
)
from pymooncake.p2p.policy import choose, fetchers, holder_loads


def test_cut_shards_covers_every_byte_once() -> None:
    cut = cut_shards([10, 0, 4, 8], 4)
    assert cut == [(0, 0, 4), (0, 4, 4), (0, 8, 2), (2, 0, 4), (3, 0, 4), (3, 4, 4)]
    with pytest.raises(ValueError, match="shard size"):
        cut_shards([1], 0)


def test_manifest_roundtrip_checksums_and_id() -> None:
    data = [bytes(range(256)) * 40, b"", b"xyz"]
    entries = [Entry("a/b.safetensors", len(data[0])), Entry("empty", 0), Entry("c", 3)]
    m = build_manifest("org/model", "files", entries, [memoryview(d) for d in data], 4096)
    assert [s.size for s in m.shards] == [4096, 4096, 2048, 3]
    assert m.shards[0].blake3 == blake3.blake3(data[0][:4096]).hexdigest()
    assert Manifest.decode(m.encode()) == m
    assert m.total_bytes == 10243
    # same content, other name -> same id; one byte changed -> another id
    same = build_manifest("other", "files", entries, [memoryview(d) for d in data], 4096)
    assert same.manifest_id == m.manifest_id
    data[2] = b"xyZ"
    assert build_manifest("org/model", "files", entries, [memoryview(d) for d in data],
                          4096).manifest_id != m.manifest_id


@pytest.mark.parametrize("raw", [b"", b"{}", b"[1]", b'{"name": "x", "kind": "files", '
                                 b'"shard_bytes": 4, "manifest_id": "", "entries": '
                                 b'[["a", 4, null, null]], "shards": [[0, 2, 4, "h"]]}'])
def test_malformed_manifest_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match="malformed P2P manifest"):
        Manifest.decode(raw)


def test_holder_record_roundtrip_and_bad_record() -> None:
    h = Holder("seg", "mid", [1, 0], have=0b1011, pulling={"x": 2}, fetching=[2], host="h")
    back = Holder.decode(h.encode())
    assert back == h and back.has(3) and not back.has(2) and back.count() == 3
    with pytest.raises(ValueError, match="malformed P2P holder"):
        Holder.decode(b'{"segment": 1}')


def test_names_and_keys() -> None:
    assert check_name("org/model") == "org/model"
    for bad in ("", "a\nb", "x" * 300):
        with pytest.raises(ValueError):
            check_name(bad)
    with pytest.raises(TypeError):
        check_name(3)
    # "org" and "org/model" never share a key prefix
    assert not holders_prefix("org/model").startswith(holders_prefix("org"))
    assert holder_key("org", "s").startswith(holders_prefix("org"))
    assert name_from_manifest_key(manifest_key("org/model")) == "org/model"


def _h(seg: str, shards: list[int], pulling: dict[str, int] | None = None,
       fetching: list[int] | None = None) -> Holder:
    return Holder(seg, "m", [0], sum(1 << s for s in shards), pulling or {}, fetching or [])


def test_choose_rarest_shard_then_least_loaded_holder() -> None:
    rng = random.Random(0)
    holders = {"seed": _h("seed", [0, 1, 2, 3]), "a": _h("a", [0, 1]), "b": _h("b", [0, 2])}
    # shard 3 has one holder: rarest
    assert choose({0, 1, 2, 3}, holders, {}, (), (), rng) == (3, "seed")
    # among 1 and 2 (two holders each) pick one of them; the seed (most shards) is avoided
    for _ in range(20):
        shard, seg = choose({1, 2}, holders, {}, (), (), rng)
        assert (shard, seg) in {(1, "a"), (2, "b")}
    # least-loaded beats fewest shards
    assert choose({1}, holders, {"a": 3, "seed": 0}, (), (), rng) == (1, "seed")


def test_choose_skips_excluded_and_bad_and_prefers_unfetched() -> None:
    rng = random.Random(1)
    holders = {"seed": _h("seed", [0, 1]), "a": _h("a", [0], fetching=[1])}
    assert choose({0}, holders, {}, {"a"}, (), rng) == (0, "seed")
    assert choose({0}, holders, {}, (), {(0, "a")}, rng) == (0, "seed")
    assert choose({0}, holders, {}, {"seed"}, {(0, "a")}, rng) is None
    assert choose(set(), holders, {}, (), (), rng) is None
    # shards 1 and 2 both seed-only; 1 is being fetched by "a": take 2
    holders["seed"] = _h("seed", [0, 1, 2])
    assert choose({1, 2}, holders, {}, (), (), rng, fetchers(holders)) == (2, "seed")


def test_holder_loads_count_others_records_and_our_own_pulls() -> None:
    holders = {"seed": _h("seed", [0]), "a": _h("a", [0], pulling={"seed": 2}),
               "me": _h("me", [], pulling={"seed": 5})}
    assert holder_loads(holders, {"a": 1}, "me") == {"seed": 2, "a": 1, "me": 0}
