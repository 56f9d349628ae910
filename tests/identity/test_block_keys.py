"""Chained block keys (DESIGN.md §3): prefix semantics, full blocks only, determinism across
processes (CASES BUG-04, BUG-05), collision resistance (BUG-07), bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import blake3
import numpy as np
import pytest

from pymooncake.identity import (
    BLOCK_KEY_HEX_LEN,
    CacheNamespace,
    block_keys,
    encode_block_tokens,
    kv_layout_descriptor,
)

from .reference import namespace_root, reference_keys

LAYOUT = kv_layout_descriptor(2, 2, 8, "float16")


def make_ns(**overrides: object) -> CacheNamespace:
    fields: dict[str, object] = dict(model_id="M", weight_revision="rev-1",
                                     tokenizer_fingerprint="K", kv_dtype="float16",
                                     kv_layout=LAYOUT, block_size=16)
    fields.update(overrides)
    return CacheNamespace(**fields)  # type: ignore[arg-type]


# Golden keys of CASES BUG-04: model M, tokenizer K, no adapter, tokens range(32), B=16
# (weight revision "rev-1", kv float16, layout 2 layers x 2 kv heads x head_dim 8).
# Derived by tests/identity/reference.py (hand-written msgpack + struct + blake3 from the
# documented encoding), not by calling block_keys; test_golden_matches_reference re-derives.
GOLDEN_BUG04 = [
    "c1f99d934e6b30fe7e0cb442e8fec6fe32c150e358808f2d721f23d19da3a2bb",
    "cb061442fbc51f3e8106f8798ff7f8323f1f10e97867e1aed701d7d835402b78",
]


class TestPrefixSemantics:
    def test_same_tokens_same_keys(self) -> None:
        ns = make_ns()
        toks = list(range(100, 164))
        assert block_keys(toks, ns) == block_keys(np.array(toks, dtype=np.int32), ns)
        assert block_keys(toks, ns) == block_keys(list(toks), make_ns())

    def test_keys_are_fixed_length_hex(self) -> None:
        keys = block_keys(range(64), make_ns())
        assert len(keys) == 4
        for k in keys:
            assert len(k) == BLOCK_KEY_HEX_LEN == 64
            int(k, 16)
            assert k == k.lower()
        assert len(set(keys)) == 4

    def test_same_block_after_different_prefix_differs(self) -> None:
        ns = make_ns()
        block = list(range(500, 516))
        a = block_keys(list(range(16)) + block, ns)
        b = block_keys(list(range(1, 17)) + block, ns)
        assert a[0] != b[0] and a[1] != b[1]
        # ... and the first key is the block's key only at position 0
        assert block_keys(block, ns)[0] not in (a[1], b[1])

    def test_shared_prefix_shares_keys_then_diverges(self) -> None:
        ns = make_ns()
        a = block_keys(list(range(48)), ns)
        b = block_keys(list(range(32)) + [7] * 16, ns)
        assert a[:2] == b[:2] and a[2] != b[2]

    @pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 47])
    def test_only_full_blocks_get_keys(self, n: int) -> None:
        ns = make_ns()
        keys = block_keys(list(range(n)), ns)
        assert len(keys) == n // 16
        # the partial tail changes nothing
        assert keys == block_keys(list(range(n // 16 * 16)), ns)

    def test_partial_tail_is_ignored_whatever_it_holds(self) -> None:
        ns = make_ns()
        assert block_keys(list(range(16)) + [1, 2, 3], ns) == \
            block_keys(list(range(16)) + [9, 9, 9, 9, 9], ns)

    @pytest.mark.parametrize("field,value", [
        ("model_id", "M2"), ("weight_revision", "rev-2"), ("tokenizer_fingerprint", "K2"),
        ("kv_dtype", "bfloat16"), ("kv_layout", kv_layout_descriptor(3, 2, 8, "float16")),
        ("tp_size", 2), ("adapter_id", "a" * 64), ("tenant_salt", "tenant-1"),
        ("extra", {"k": "v"}), ("block_size", 8),
    ])
    def test_each_namespace_field_changes_every_key(self, field: str, value: object) -> None:
        toks = list(range(64))
        base = block_keys(toks, make_ns())
        changed_ns = make_ns(**{field: value})
        changed = block_keys(toks, changed_ns)
        assert changed_ns.digest() != make_ns().digest()
        if field == "block_size":
            # different block boundaries: no key may coincide with a base key
            assert not set(changed) & set(base)
        else:
            assert len(changed) == len(base) == 4
            assert all(x != y for x, y in zip(base, changed, strict=True))
            assert not set(changed) & set(base)

    def test_tp_rank_changes_every_key(self) -> None:
        toks = list(range(64))
        a = block_keys(toks, make_ns(tp_size=2, tp_rank=0))
        b = block_keys(toks, make_ns(tp_size=2, tp_rank=1))
        assert all(x != y for x, y in zip(a, b, strict=True))


class TestGolden:
    def test_golden_matches_reference(self) -> None:
        root = namespace_root(
            model_id="M", weight_revision="rev-1", tokenizer_fingerprint="K",
            kv_dtype="float16",
            kv_layout="paged_lkhd;layers=2;kv_heads=2;head_dim=8;elem_bytes=2", block_size=16)
        assert reference_keys(list(range(32)), 16, root) == GOLDEN_BUG04

    def test_bug_04_golden_keys_in_this_process(self) -> None:
        assert block_keys(range(32), make_ns()) == GOLDEN_BUG04

    def test_reference_agrees_on_all_fields_set(self) -> None:
        ns = make_ns(tp_rank=1, tp_size=4, adapter_id="ad", tenant_salt="t",
                     extra={"b": "2", "a": "1"}, block_size=8)
        root = namespace_root(model_id="M", weight_revision="rev-1", tokenizer_fingerprint="K",
                              kv_dtype="float16", kv_layout=LAYOUT, block_size=8, tp_rank=1,
                              tp_size=4, adapter_id="ad", tenant_salt="t",
                              extra=[["a", "1"], ["b", "2"]])
        assert ns.digest_bytes() == root
        toks = [0, 1, 2**32 - 1, 70000, 5, 6, 7, 8] * 3 + [1]
        assert block_keys(toks, ns) == reference_keys(toks, 8, root)


# One script run in fresh interpreters: BUG-04 keys, BUG-05 variants, BUG-01 pairs.
_CHILD = textwrap.dedent("""
    import json
    from pymooncake.identity import CacheNamespace, block_keys, kv_layout_descriptor
    base = dict(model_id="M", weight_revision="rev-1", tokenizer_fingerprint="K",
                kv_dtype="float16", kv_layout=kv_layout_descriptor(2, 2, 8, "float16"))
    out = {"bug04": block_keys(range(32), CacheNamespace(**base, block_size=16))}
    c = dict(base, block_size=256)
    out["bug05"] = {
        "absent": block_keys(range(256), CacheNamespace(**c)),
        "none": block_keys(range(256), CacheNamespace(**c, extra=None)),
        "tuple": block_keys(range(256), CacheNamespace(**c, extra=())),
        "dict": block_keys(range(256), CacheNamespace(**c, extra={})),
        "set": block_keys(range(256), CacheNamespace(**c, extra={"lora": "x"})),
    }
    print(json.dumps(out))
""")


def _run_child(hashseed: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hashseed is not None:
        env["PYTHONHASHSEED"] = hashseed
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def two_processes() -> tuple[dict, dict]:
    return _run_child(None), _run_child("123")


class TestAcrossProcesses:
    def test_bug_04_two_processes_identical_and_golden(self, two_processes) -> None:  # noqa: ANN001
        unset, pinned = two_processes
        assert unset["bug04"] == pinned["bug04"] == GOLDEN_BUG04

    def test_bug_05_absent_none_empty_are_one_identity(self, two_processes) -> None:  # noqa: ANN001
        unset, pinned = two_processes
        assert unset["bug05"] == pinned["bug05"]
        v = unset["bug05"]
        # Stated rule (identity/namespace.py): absent, None, () and {} are ONE identity ...
        assert v["absent"] == v["none"] == v["tuple"] == v["dict"]
        assert len(v["absent"]) == 1
        # ... equal to the documented encoding with an empty "extra" list ...
        root = namespace_root(
            model_id="M", weight_revision="rev-1", tokenizer_fingerprint="K",
            kv_dtype="float16",
            kv_layout="paged_lkhd;layers=2;kv_heads=2;head_dim=8;elem_bytes=2", block_size=256)
        assert v["absent"] == reference_keys(list(range(256)), 256, root)
        # ... and a non-empty extra identity is another identity.
        assert v["set"] != v["absent"]


class TestCollisions:
    def test_bug_07_default_hash_is_blake3_256(self) -> None:
        ns = make_ns()
        toks = list(range(16))
        expected = blake3.blake3(ns.digest_bytes()
                                 + np.arange(16, dtype="<u4").tobytes()).hexdigest()
        assert block_keys(toks, ns) == [expected]
        assert len(expected) * 4 == 256 >= 128

    def test_bug_07_100k_random_blocks_no_collision(self) -> None:
        rng = np.random.default_rng(7)
        blocks = rng.integers(0, 2**17, size=(100_000, 16), dtype=np.int64)
        assert len({b.tobytes() for b in blocks}) == 100_000  # distinct inputs
        ns = make_ns()
        # each block hashed as the first block under the namespace root
        keys = {block_keys(b, ns)[0] for b in blocks}
        assert len(keys) == 100_000

    def test_bug_07_weak_hash_forces_a_collision(self) -> None:
        """Step 2, identity part: the test-only 8-bit hash makes two different blocks share a
        key (the engine's lookup must then compare token ids; see tests/engine)."""

        def weak(data: bytes) -> bytes:
            return blake3.blake3(data).digest()[:1]

        ns = make_ns()
        x = list(range(1, 17))
        kx = block_keys(x, ns, hash_fn=weak)[0]
        assert len(kx) == 2  # 8 bits as hex
        # among 257 distinct blocks two share a key (pigeonhole); find Y colliding with X
        y = next(list(range(17 + i, 33 + i)) for i in range(10_000)
                 if block_keys(list(range(17 + i, 33 + i)), ns, hash_fn=weak)[0] == kx)
        assert y != x
        assert block_keys(y, ns, hash_fn=weak)[0] == kx
        # the production hash tells them apart
        assert block_keys(y, ns) != block_keys(x, ns)


class TestBadInput:
    @pytest.mark.parametrize("tokens,match", [
        ([1, -1], r"\[0, 2\*\*32\)"),
        ([2**32], r"\[0, 2\*\*32\)"),
        ([2**70], r"\[0, 2\*\*32\)"),
        ([1.0, 2.0], r"integers"),
        (np.array([0.5]), r"integers"),
        (["a"], r"integers"),
        ([1, None], r"got None"),
        ([[1, 2], [3, 4]], r"one-dimensional"),
        (np.array([True, False]), r"integers"),
    ])
    def test_bad_token_ids(self, tokens: object, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            block_keys(tokens, make_ns())  # type: ignore[arg-type]

    def test_encoding_is_uint32_little_endian(self) -> None:
        enc = encode_block_tokens([1, 2**32 - 1])
        assert enc.tobytes() == b"\x01\x00\x00\x00\xff\xff\xff\xff"
        assert encode_block_tokens(np.array([5], dtype=np.uint64)).tobytes() == b"\x05\0\0\0"
