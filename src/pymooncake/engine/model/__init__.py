"""Llama-family decoder in PyTorch, its loader (safetensors) and the seeded tiny default."""
