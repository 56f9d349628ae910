"""Paged KV cache: block pool (pure), cache manager (pure), per-layer K/V tensors (torch)."""
