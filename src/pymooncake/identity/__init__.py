"""What a KV block *is*: the cache namespace and chained prefix block keys (DESIGN.md §3).

``key_i = H(key_{i-1} ‖ tokens(block_i))`` with ``key_{-1} = H(namespace)``; ``H`` is
BLAKE3-256. Only full blocks get keys.
"""

from pymooncake.identity.block_keys import (
    BLOCK_KEY_HEX_LEN,
    BlockKey,
    block_keys,
    encode_block_tokens,
)
from pymooncake.identity.fingerprint import adapter_fingerprint, tokenizer_fingerprint
from pymooncake.identity.namespace import KV_DTYPE_BYTES, CacheNamespace, kv_layout_descriptor

__all__ = [
    "BLOCK_KEY_HEX_LEN",
    "KV_DTYPE_BYTES",
    "BlockKey",
    "CacheNamespace",
    "adapter_fingerprint",
    "block_keys",
    "encode_block_tokens",
    "kv_layout_descriptor",
    "tokenizer_fingerprint",
]
