"""Chunked pipeline parallelism (CPP) for long prefills (Mooncake FAST'25 §5.1, docs/cpp.md).

``model.StageModel`` (a contiguous layer range), ``runtime.StageRuntime`` (its paged KV and
the chunks of each prompt), ``stage`` (the stage process: RPC server, compute and send
threads) and ``group.CppGroup`` (starts a group of stages, prefills a prompt through them,
collects their KV for a decode engine).
"""
