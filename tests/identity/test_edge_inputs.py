"""Identity API edge inputs: each is a clear error naming the field, never a deep crash."""

from __future__ import annotations

import pytest

from pymooncake.identity import (
    CacheNamespace,
    adapter_fingerprint,
    block_keys,
    kv_layout_descriptor,
    tokenizer_fingerprint,
)


def ns(**kw) -> CacheNamespace:
    base = dict(model_id="M", weight_revision="r", tokenizer_fingerprint="K",
                kv_dtype="float16", kv_layout=kv_layout_descriptor(2, 1, 8, "float16"),
                block_size=4)
    base.update(kw)
    return CacheNamespace(**base)


@pytest.mark.parametrize("kw, fragment", [
    ({"block_size": 10**30}, "CacheNamespace.block_size must be an int in [1, 1048576]"),
    ({"tp_size": 2**21}, "CacheNamespace.tp_size must be an int in [1, 1048576]"),
    ({"model_id": "   "}, "CacheNamespace.model_id must not be empty or blank"),
    ({"kv_layout": " \t"}, "CacheNamespace.kv_layout must not be empty or blank"),
])
def test_namespace_bounds(kw, fragment) -> None:
    with pytest.raises(ValueError) as e:
        ns(**kw)
    assert fragment in str(e.value)


@pytest.mark.parametrize("bad", [None, "ns", 4])
def test_block_keys_needs_a_namespace(bad) -> None:
    with pytest.raises(TypeError, match="namespace must be a CacheNamespace"):
        block_keys([1, 2, 3, 4], bad)


def test_fingerprint_argument_types(tmp_path) -> None:
    with pytest.raises(TypeError, match="chat_template must be a str"):
        tokenizer_fingerprint(None, 5)
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        tokenizer_fingerprint(f)
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        adapter_fingerprint(f)
    with pytest.raises(TypeError, match="adapter_files must be a directory path or a dict"):
        adapter_fingerprint(b"x")
