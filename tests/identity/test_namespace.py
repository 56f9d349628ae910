"""Cache namespace: unambiguous tagged encoding (CASES BUG-01), adapter content identity
(BUG-02), KV format and layout in the key (BUG-06), validation, fingerprints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pymooncake.identity import (
    KV_DTYPE_BYTES,
    CacheNamespace,
    adapter_fingerprint,
    block_keys,
    kv_layout_descriptor,
    tokenizer_fingerprint,
)


def ns4(**overrides: object) -> CacheNamespace:
    """CASES BUG-01 set-up: B=4, model M, tokenizer K."""
    fields: dict[str, object] = dict(model_id="M", weight_revision="rev-1",
                                     tokenizer_fingerprint="K", kv_dtype="float32",
                                     kv_layout=kv_layout_descriptor(2, 2, 8, "float32"),
                                     block_size=4)
    fields.update(overrides)
    return CacheNamespace(**fields)  # type: ignore[arg-type]


T = [1, 2, 3, 4, 5, 6, 7, 8]


def differ_at_every_index(a: list[str], b: list[str]) -> bool:
    return len(a) == len(b) > 0 and all(x != y for x, y in zip(a, b, strict=True))


class TestBug01FieldKindsAreSeparated:
    @pytest.mark.parametrize("a,b", [
        (dict(adapter_id="S", tenant_salt=None), dict(adapter_id=None, tenant_salt="S")),
        (dict(adapter_id="a|b"), dict(adapter_id="a", tenant_salt="b")),
        (dict(adapter_id=""), dict(adapter_id=None)),
        (dict(tenant_salt=""), dict(tenant_salt=None)),
        (dict(adapter_id="ab", tenant_salt=""), dict(adapter_id="a", tenant_salt="b")),
        (dict(extra={"adapter_id": "S"}), dict(adapter_id="S")),
        (dict(model_id="M", weight_revision="1x"), dict(model_id="M1", weight_revision="x")),
    ])
    def test_bug_01_pairs_differ_at_every_block(self, a: dict, b: dict) -> None:
        ka, kb = block_keys(T, ns4(**a)), block_keys(T, ns4(**b))
        assert len(ka) == 2
        assert differ_at_every_index(ka, kb)

    def test_bug_01_encoding_is_injective_on_string_splits(self) -> None:
        # Every way of splitting "abc" over (adapter_id, tenant_salt) is a distinct identity.
        splits = [("abc", None), (None, "abc"), ("abc", ""), ("", "abc"), ("a", "bc"),
                  ("ab", "c"), ("a|", "bc"), ("", ""), (None, None), ("", None), (None, "")]
        digests = {ns4(adapter_id=a, tenant_salt=s).digest() for a, s in splits}
        assert len(digests) == len(splits)


class TestBug02AdapterContent:
    def test_bug_02_same_name_different_weights_different_keys(self, tmp_path: Path) -> None:
        w1 = np.arange(64, dtype=np.float32).tobytes()
        w2 = (np.arange(64, dtype=np.float32) + 1e-3).tobytes()
        d1, d2 = adapter_fingerprint({"adapter_model.safetensors": w1}), \
            adapter_fingerprint({"adapter_model.safetensors": w2})
        assert d1 != d2
        p = list(range(12))  # prompt P, 12 tokens, B=4
        k1 = block_keys(p, ns4(adapter_id=d1))
        k2 = block_keys(p, ns4(adapter_id=d2))
        assert len(k1) == 3 and differ_at_every_index(k1, k2)
        # the registration name is not part of the identity: one content, one identity
        for name, w in (("ft", w1), ("other-name", w1)):
            d = tmp_path / name
            d.mkdir()
            (d / "adapter_model.safetensors").write_bytes(w)
            assert adapter_fingerprint(d) == d1

    def test_adapter_fingerprint_sees_every_file(self, tmp_path: Path) -> None:
        base = {"adapter_model.safetensors": b"w", "adapter_config.json": b'{"r": 8}'}
        assert adapter_fingerprint(base) != adapter_fingerprint(
            {**base, "adapter_config.json": b'{"r": 16}'})
        # file boundaries are length-prefixed: moving bytes between files changes the digest
        assert adapter_fingerprint({"a": b"xy", "b": b""}) != adapter_fingerprint(
            {"a": b"x", "b": b"y"})

    def test_adapter_fingerprint_bad_input(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError, match="does not exist"):
            adapter_fingerprint(tmp_path / "missing")
        with pytest.raises(FileNotFoundError, match="empty"):
            adapter_fingerprint(tmp_path)
        with pytest.raises(ValueError, match="empty"):
            adapter_fingerprint({})
        with pytest.raises(ValueError, match="bytes"):
            adapter_fingerprint({"a": "text"})  # type: ignore[dict-item]


class TestBug06KvFormat:
    def _ns(self, dtype: str, **kw: object) -> CacheNamespace:
        return CacheNamespace(model_id="M", weight_revision="rev-1", tokenizer_fingerprint="K",
                              kv_dtype=dtype, kv_layout=kv_layout_descriptor(4, 8, 64, dtype),
                              block_size=16, **kw)  # type: ignore[arg-type]

    @pytest.mark.parametrize("other", ["int8", "float8_e4m3fn", "float8_e5m2", "bfloat16"])
    def test_bug_06_kv_dtype_changes_every_key(self, other: str) -> None:
        p = list(range(64))
        a = block_keys(p, self._ns("float16"))
        b = block_keys(p, self._ns(other))
        assert len(a) == 4 and differ_at_every_index(a, b)
        assert not set(a) & set(b)  # B gets 0 external hit tokens

    def test_bug_06_tp_shard_0_of_2_vs_0_of_1(self) -> None:
        p = list(range(64))
        a = block_keys(p, self._ns("float16", tp_rank=0, tp_size=2))
        b = block_keys(p, self._ns("float16", tp_rank=0, tp_size=1))
        assert differ_at_every_index(a, b)

    def test_bug_06_layout_descriptor_commits_to_format(self) -> None:
        d = kv_layout_descriptor(num_layers=4, num_kv_heads_per_shard=8, head_dim=64,
                                 kv_dtype="int8")
        assert d == "paged_lkhd;layers=4;kv_heads=8;head_dim=64;elem_bytes=1"
        variants = {kv_layout_descriptor(*args) for args in [
            (4, 8, 64, "float16"), (4, 8, 64, "int8"), (5, 8, 64, "float16"),
            (4, 4, 64, "float16"), (4, 8, 128, "float16"), (4, 8, 64, "float32")]}
        assert len(variants) == 6

    def test_layout_elem_bytes_must_match_dtype(self) -> None:
        with pytest.raises(ValueError, match="elem_bytes=2 but kv_dtype 'int8'"):
            CacheNamespace(model_id="M", weight_revision="r", tokenizer_fingerprint="K",
                           kv_dtype="int8", kv_layout=kv_layout_descriptor(4, 8, 64, "float16"),
                           block_size=16)

    @pytest.mark.parametrize("args,match", [
        ((0, 8, 64, "float16"), "num_layers"), ((4, -1, 64, "float16"), "num_kv_heads"),
        ((4, 8, True, "float16"), "head_dim"), ((4, 8, 64, "fp17"), "unknown kv_dtype"),
    ])
    def test_layout_descriptor_bad_input(self, args: tuple, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            kv_layout_descriptor(*args)

    def test_layout_name_cannot_smuggle_fields(self) -> None:
        with pytest.raises(ValueError, match="layout must be"):
            kv_layout_descriptor(4, 8, 64, "float16", layout="x;layers=9")


class TestNamespaceValidation:
    @pytest.mark.parametrize("field,value,match", [
        ("model_id", "", "model_id must not be empty"),
        ("model_id", 3, "model_id must be str"),
        ("weight_revision", "", "weight_revision must not be empty"),
        ("tokenizer_fingerprint", None, "tokenizer_fingerprint must be str"),
        ("kv_layout", "", "kv_layout must not be empty"),
        ("kv_dtype", "fp16", "kv_dtype 'fp16' unknown"),
        ("block_size", 0, "block_size must be an int in \\[1, 1048576\\]"),
        ("block_size", 16.0, "block_size must be an int"),
        ("block_size", True, "block_size must be an int"),
        ("tp_size", 0, "tp_size must be an int in \\[1, 1048576\\]"),
        ("tp_rank", 1, r"tp_rank must be in \[0, 1\)"),
        ("tp_rank", True, "tp_rank must be an int"),
        ("tp_rank", -1, r"tp_rank must be in \[0, 1\)"),
        ("adapter_id", 5, "adapter_id must be str or None"),
        ("tenant_salt", b"s", "tenant_salt must be str or None"),
        ("extra", "ab", "extra must be a mapping"),
        ("extra", {"k": 1}, "extra keys and values must be str"),
        ("extra", [("k", "a"), ("k", "b")], "duplicate keys"),
    ])
    def test_bad_field(self, field: str, value: object, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            ns4(**{field: value})

    def test_numpy_ints_are_plain_ints(self) -> None:
        a = ns4(block_size=np.int64(4), tp_size=np.int32(2), tp_rank=np.int64(1))
        b = ns4(block_size=4, tp_size=2, tp_rank=1)
        assert a == b and a.digest() == b.digest() and type(a.block_size) is int

    def test_extra_order_does_not_matter(self) -> None:
        assert ns4(extra={"a": "1", "b": "2"}).digest() == \
            ns4(extra=[("b", "2"), ("a", "1")]).digest()

    def test_frozen(self) -> None:
        ns = ns4()
        with pytest.raises(AttributeError):
            ns.model_id = "X"  # type: ignore[misc]

    def test_dtype_table_widths(self) -> None:
        assert KV_DTYPE_BYTES["float16"] == 2 and KV_DTYPE_BYTES["int8"] == 1
        assert KV_DTYPE_BYTES["float32"] == 4 and KV_DTYPE_BYTES["float64"] == 8


class TestTokenizerFingerprint:
    def test_content_and_template_decide(self, tmp_path: Path) -> None:
        (tmp_path / "tokenizer.json").write_text('{"v": 1}')
        (tmp_path / "README.md").write_text("not part of the identity")
        a = tokenizer_fingerprint(tmp_path)
        (tmp_path / "README.md").write_text("changed")
        assert tokenizer_fingerprint(tmp_path) == a
        assert tokenizer_fingerprint(tmp_path, chat_template="{{ x }}") != a
        (tmp_path / "tokenizer.json").write_text('{"v": 2}')
        assert tokenizer_fingerprint(tmp_path) != a
        assert len(a) == 64

    def test_template_only_and_bad_dirs(self, tmp_path: Path) -> None:
        assert tokenizer_fingerprint(chat_template="a") != tokenizer_fingerprint(
            chat_template="b")
        with pytest.raises(FileNotFoundError, match="does not exist"):
            tokenizer_fingerprint(tmp_path / "nope")
        with pytest.raises(FileNotFoundError, match="holds none"):
            tokenizer_fingerprint(tmp_path)
