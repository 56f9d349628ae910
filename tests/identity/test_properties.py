"""Property tests: the namespace encoding is injective (CASES BUG-01: no choice of string
values makes two different identity tuples encode alike) and keys follow prefixes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pymooncake.identity import CacheNamespace, block_keys, kv_layout_descriptor

_TEXT = st.sampled_from(["", "a", "b", "a|b", "|", "ab", "S", "\x00", "é"])
_OPT = st.none() | _TEXT
_EXTRA = st.none() | st.dictionaries(st.sampled_from(["k", "a", "lora"]), _TEXT, max_size=2)


@st.composite
def namespaces(draw: st.DrawFn) -> CacheNamespace:
    tp_size = draw(st.sampled_from([1, 2]))
    return CacheNamespace(
        model_id=draw(st.sampled_from(["M", "M|", "Ma"])),
        weight_revision=draw(st.sampled_from(["r", "|r", "ar"])),
        tokenizer_fingerprint="K",
        kv_dtype="float16",
        kv_layout=kv_layout_descriptor(draw(st.sampled_from([1, 2])), 2, 8, "float16"),
        block_size=4,
        tp_rank=draw(st.integers(0, tp_size - 1)),
        tp_size=tp_size,
        adapter_id=draw(_OPT),
        tenant_salt=draw(_OPT),
        extra=draw(_EXTRA),
    )


@settings(max_examples=300, deadline=None)
@given(namespaces(), namespaces())
def test_digest_equal_iff_namespace_equal(a: CacheNamespace, b: CacheNamespace) -> None:
    assert (a.digest() == b.digest()) == (a == b)
    if a != b:
        ka, kb = block_keys(range(8), a), block_keys(range(8), b)
        assert all(x != y for x, y in zip(ka, kb, strict=True))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=24),
       st.lists(st.integers(0, 3), min_size=0, max_size=24))
def test_keys_shared_exactly_over_the_common_full_block_prefix(x: list[int],
                                                               y: list[int]) -> None:
    ns = CacheNamespace(model_id="M", weight_revision="r", tokenizer_fingerprint="K",
                        kv_dtype="float16", kv_layout="l", block_size=4)
    kx, ky = block_keys(x, ns), block_keys(y, ns)
    common = 0
    while common < min(len(kx), len(ky)) and x[4 * common:4 * common + 4] == \
            y[4 * common:4 * common + 4]:
        common += 1
    assert kx[:common] == ky[:common]
    assert not set(kx[common:]) & set(ky[common:])
