"""The vLLM connector's pure parts (no vLLM needed): configuration, namespace, keys, plans."""

from __future__ import annotations

import blake3
import numpy as np
import pytest

from pymooncake.identity import block_keys
from pymooncake.integrations.vllm.plan import (
    VLLM_CPU_LAYOUT,
    BlockTransfer,
    ConnectorConfig,
    Planner,
    kv_dtype_name,
    layer_index,
    leading_hits,
    loadable_blocks,
    object_keys,
    request_namespace,
    tail_key,
    vllm_namespace,
    weight_digest,
)

NS = dict(model_id="smol", weight_revision="w1", tokenizer_fingerprint="t1", kv_dtype="float32",
          num_layers=30, num_kv_heads=3, head_dim=64, block_size=128)


def test_config_requires_master_and_metadata_and_names_bad_keys() -> None:
    with pytest.raises(ValueError, match="master is required"):
        ConnectorConfig.from_extra({"metadata": "http://h:1/metadata"})
    with pytest.raises(ValueError, match="metadata is required"):
        ConnectorConfig.from_extra({"master": "h:1"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['mastr'\]"):
        ConnectorConfig.from_extra({"master": "h:1", "metadata": "m", "mastr": "x"})
    with pytest.raises(ValueError, match="rpc_timeout_s must be a number > 0"):
        ConnectorConfig.from_extra({"master": "h:1", "metadata": "m", "rpc_timeout_s": 0})
    with pytest.raises(ValueError, match="save must be true or false"):
        ConnectorConfig.from_extra({"master": "h:1", "metadata": "m", "save": "no"})
    with pytest.raises(ValueError, match=r"master must be a string, e\.g\. "
                       r"'127\.0\.0\.1:50051', got int 50051"):
        ConnectorConfig.from_extra({"master": 50051, "metadata": "m"})
    with pytest.raises(ValueError, match="pd_hold_s must be a number > 0, got -1"):
        ConnectorConfig.from_extra({"master": "h:1", "metadata": "m", "pd_hold_s": -1})
    assert ConnectorConfig.from_extra({"master": "h:1", "metadata": "m"}).pd_hold_s == 120.0
    with pytest.raises(ValueError, match="tenant_salt must be a string"):
        ConnectorConfig.from_extra({"master": "h:1", "metadata": "m", "tenant_salt": 7})
    c = ConnectorConfig.from_extra({"master": "h:1", "metadata": "m", "transports": "shm, tcp",
                                    "tenant_salt": "acme", "rpc_timeout_s": 2})
    assert (c.transports, c.tenant_salt, c.rpc_timeout_s, c.load, c.save) == \
        (("shm", "tcp"), "acme", 2.0, True, True)


def test_kv_dtype_names() -> None:
    assert kv_dtype_name("torch.float32") == "float32"
    assert kv_dtype_name("bfloat16") == "bfloat16"
    assert kv_dtype_name("fp8_e5m2") == "float8_e5m2"
    with pytest.raises(ValueError, match="'int4' is not supported"):
        kv_dtype_name("int4")


def test_namespace_commits_to_every_field() -> None:
    base = vllm_namespace(**NS)
    assert base.kv_layout == f"{VLLM_CPU_LAYOUT};layers=30;kv_heads=3;head_dim=64;elem_bytes=4"
    variants = [dict(model_id="other"), dict(weight_revision="w2"),
                dict(tokenizer_fingerprint="t2"), dict(kv_dtype="bfloat16"),
                dict(num_layers=29), dict(num_kv_heads=4), dict(head_dim=32),
                dict(block_size=32), dict(tenant_salt="acme")]
    digests = {base.digest()} | {vllm_namespace(**(NS | v)).digest() for v in variants}
    assert len(digests) == len(variants) + 1
    tokens = list(range(1000, 1256))
    assert block_keys(tokens, base) != block_keys(tokens, vllm_namespace(**NS, tenant_salt="a"))


def test_weight_digest_is_content_and_name(tmp_path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    (tmp_path / "config.json").write_text("{}")  # not a weight file: not hashed
    d1 = weight_digest(tmp_path)
    h = blake3.blake3(b"pymooncake.integrations.vllm.weights/v1\x00")
    name = b"model.safetensors"
    h.update(len(name).to_bytes(8, "little") + name + (3).to_bytes(8, "little") + b"abc")
    assert d1 == h.hexdigest()
    (tmp_path / "config.json").write_text('{"x": 1}')
    assert weight_digest(tmp_path) == d1
    (tmp_path / "model.safetensors").write_bytes(b"abd")
    assert weight_digest(tmp_path) != d1
    with pytest.raises(FileNotFoundError, match="set kv_connector_extra_config.weight_revision"):
        weight_digest(tmp_path / "missing")


def test_keys_and_hits() -> None:
    assert layer_index("model.layers.7.self_attn.attn") == 7
    assert layer_index("12") == 12
    with pytest.raises(ValueError, match="no layer number in KV cache name 'lm_head'"):
        layer_index("lm_head")
    assert object_keys(["a", "b"], 2) == ["a.L0", "a.L1", "b.L0", "b.L1"]
    assert [loadable_blocks(n, 128) for n in (0, 1, 128, 129, 256, 2048)] == [0, 0, 0, 1, 1, 15]
    # block 0 complete, block 1 misses layer 1, block 2 complete: only block 0 is a hit
    assert leading_hits([True, True, True, False, True, True], 2) == 1
    assert leading_hits([], 2) == 0
    assert leading_hits([True] * 6, 3) == 2
    with pytest.raises(ValueError, match="whole blocks"):
        leading_hits([True] * 5, 2)


def test_planner_load_then_save_rest_of_prompt() -> None:
    p = Planner(4)
    keys = [f"k{i}" for i in range(5)]           # a 21-token prompt: 5 full blocks
    # vLLM holds 1 block itself, the Store holds 3: load blocks 1..2 (8 tokens)
    assert p.lookup("r", keys, 21, hits=3, local_tokens=4) == 8
    p.allocated("r", 8)
    load, save = p.scheduled("r", [10, 11, 12, 13, 14, 15], True, computed_before=12,
                             num_scheduled=5)    # a chunk: tokens 12..16 → block 3 completes
    assert load == BlockTransfer("r", ["k1", "k2"], [11, 12])
    assert save == BlockTransfer("r", ["k3"], [13])
    load, save = p.scheduled("r", None, False, computed_before=17, num_scheduled=4)
    assert load is None and save == BlockTransfer("r", ["k4"], [14])
    load, save = p.scheduled("r", [16], False, computed_before=21, num_scheduled=1)  # decode
    assert (load, save) == (None, None)
    p.finished("r")
    assert p.scheduled("r", [1], False, 0, 1) == (None, None)


def test_planner_miss_saves_every_full_block_and_refuses_inconsistent_counts() -> None:
    p = Planner(4)
    assert p.lookup("r", ["a", "b"], 9, hits=0, local_tokens=0) == 0
    p.allocated("r", 0)
    assert p.scheduled("r", [7, 8, 9], True, 0, 9) == (None, BlockTransfer("r", ["a", "b"],
                                                                            [7, 8]))
    assert p.lookup("x", ["a", "b"], 9, hits=2, local_tokens=8) == 0   # vLLM had it all
    with pytest.raises(ValueError, match="3 hits for a 9-token prompt"):
        p.lookup("y", ["a", "b"], 9, hits=3, local_tokens=0)
    p.lookup("z", ["a", "b"], 9, hits=1, local_tokens=0)
    with pytest.raises(ValueError, match="the Store had 4 tokens"):
        p.allocated("z", 8)


def test_tail_key_names_the_partial_block_and_its_prefix() -> None:
    ns = vllm_namespace(**(NS | {"block_size": 4}))
    toks = list(range(100, 110))                  # 2 full blocks + 2 tokens
    keys = block_keys(toks, ns)
    t = tail_key(toks, keys, ns)
    h = blake3.blake3(b"pymooncake.integrations.vllm.tail/v1\x00" + bytes.fromhex(keys[-1])
                      + np.array([108, 109], dtype="<u4").tobytes())
    assert t == h.hexdigest() and t not in keys
    other = toks[:3] + [7] + toks[4:]             # same tail tokens after another prefix
    assert tail_key(other, block_keys(other, ns), ns) != t
    assert tail_key(toks[:8], keys, ns) is None   # no partial block
    assert tail_key(toks[:2], [], ns) == blake3.blake3(
        b"pymooncake.integrations.vllm.tail/v1\x00" + ns.digest_bytes()
        + np.array([100, 101], dtype="<u4").tobytes()).hexdigest()


def test_planner_pd_prefill_puts_the_tail_and_decode_loads_all_but_the_last_token() -> None:
    p = Planner(4)
    keys = ["k0", "k1"]                           # a 10-token prompt: 2 full blocks + 2
    # prefill: a miss; the step computing the prompt's end saves the full blocks and the tail
    assert p.lookup("pre", keys, 10, hits=0, local_tokens=0, tail="T") == 0
    p.allocated("pre", 0)
    assert p.scheduled("pre", [5, 6, 7], True, 0, 8) == (
        None, BlockTransfer("pre", ["k0", "k1"], [5, 6]))          # a chunk: no tail yet
    assert p.scheduled("pre", None, False, 8, 2) == (None, BlockTransfer("pre", ["T"], [7]))
    assert p.scheduled("pre", [8], False, 10, 1) == (None, None)   # decode: nothing
    # decode: the Store has both full blocks and the tail: 9 tokens to load, 3 blocks
    assert p.lookup("dec", keys, 10, hits=2, local_tokens=0, pd_last_key="T") == 9
    p.allocated("dec", 9)
    assert p.scheduled("dec", [1, 2, 3], True, 9, 1) == (
        BlockTransfer("dec", ["k0", "k1", "T"], [1, 2, 3]), None)
    # a prompt that fills its blocks: the last key is the last full block's own
    assert p.lookup("d8", keys, 8, hits=1, local_tokens=4, pd_last_key="k1") == 3
    p.allocated("d8", 3)
    assert p.scheduled("d8", [1, 2], True, 7, 1)[0] == BlockTransfer("d8", ["k1"], [2])
    with pytest.raises(ValueError, match="needs all 2 full blocks, the Store has 1"):
        p.lookup("x", keys, 10, hits=1, local_tokens=0, pd_last_key="T")


def test_unreachable_store_is_one_clear_error_at_start() -> None:
    """vLLM builds the connector at start: a Store that cannot be reached stops it there
    with an error naming the address, instead of every request failing later."""
    from pymooncake.integrations.vllm.instance import shared_client
    from pymooncake.store.errors import ErrorCode, StoreError

    cfg = ConnectorConfig.from_extra({"master": "127.0.0.1:9", "rpc_timeout_s": 1,
                                      "metadata": "http://127.0.0.1:9/metadata"})
    with pytest.raises(StoreError) as e:
        shared_client(cfg)
    assert e.value.code == ErrorCode.RPC_FAIL and "127.0.0.1:9" in str(e.value)
    assert "kv_connector_extra_config.metadata = 'http://127.0.0.1:9/metadata'" in str(e.value)


def test_unreachable_master_names_the_config_key_and_its_address() -> None:
    """A metadata service that answers, a master that does not: the error names
    ``kv_connector_extra_config.master`` and the address (a newcomer saw only
    ``cannot connect to 127.0.0.1:1``)."""
    from pymooncake.integrations.vllm.instance import shared_client
    from pymooncake.metadata.http import MetadataHttpServer
    from pymooncake.store.errors import StoreError

    md = MetadataHttpServer().start()
    try:
        cfg = ConnectorConfig.from_extra({"master": "127.0.0.1:1", "rpc_timeout_s": 1,
                                          "metadata": md.url})
        with pytest.raises(StoreError) as e:
            shared_client(cfg)
    finally:
        md.stop()
    assert "kv_connector_extra_config.master = '127.0.0.1:1'" in str(e.value)


def test_planner_saves_blocks_of_generated_tokens_as_they_fill() -> None:
    seen = []

    def keys_of(req_id, tokens):
        assert req_id == "r"
        seen.append(list(tokens))
        return [f"g{len(tokens)}-{i}" for i in range(len(tokens) // 4)]

    p = Planner(4, keys_of=keys_of)
    prompt = list(range(6))                       # 1 full block + 2 tokens
    p.lookup("r", ["k0"], 6, hits=0, local_tokens=0)
    assert p.scheduled("r", [3, 4], True, 0, 6, tokens=prompt) == (
        None, BlockTransfer("r", ["k0"], [3]))
    # decode steps: the 7th token's KV is computed, then the 8th fills block 1
    assert p.scheduled("r", None, False, 6, 1, tokens=prompt + [50]) == (None, None)
    assert p.scheduled("r", None, False, 7, 1, tokens=prompt + [50, 51]) == (
        None, BlockTransfer("r", ["g8-1"], [4]))
    assert seen == [prompt + [50, 51]]
    # a token not sampled yet (computed ahead of the list): nothing keyed beyond the list
    assert p.scheduled("r", [5], False, 8, 4, tokens=prompt + [50, 51, 52]) == (None, None)


def test_request_namespace_folds_in_the_cache_salt_and_bypasses_lora_and_multimodal() -> None:
    """CASES BUG-66: different vLLM ``cache_salt`` values never give the same block key;
    no salt (None or "") is the instance's namespace; LoRA or multimodal requests bypass
    the Store (their KV is not a function of the token ids alone)."""
    ns = vllm_namespace(model_id="m", weight_revision="w", tokenizer_fingerprint="t",
                        kv_dtype="float32", num_layers=2, num_kv_heads=1, head_dim=8,
                        block_size=4)
    toks = list(range(12))
    base = block_keys(toks, ns)
    assert request_namespace(ns) is ns and request_namespace(ns, cache_salt="") is ns
    a = block_keys(toks, request_namespace(ns, cache_salt="tenant-a"))
    b = block_keys(toks, request_namespace(ns, cache_salt="tenant-b"))
    assert len(a) == len(b) == len(base) == 3
    assert not set(a) & set(b) and not set(a) & set(base) and not set(b) & set(base)
    assert a == block_keys(toks, request_namespace(ns, cache_salt="tenant-a"))  # stable
    assert request_namespace(ns, lora=object()) is None
    assert request_namespace(ns, cache_salt="x", multimodal=[object()]) is None
    assert request_namespace(ns, multimodal=[]) is ns
