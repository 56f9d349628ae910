"""The decode worker's own admission re-check (DESIGN.md §1 step 4): KV blocks and batch
slots counted with requests admitted but not started, and the TBT SLO against the step
times it measured (``StepTimeModel``). Unit level: the worker's handler on a real tiny
engine, no sockets."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from pymooncake.engine.worker.tbt_model import StepTimeModel  # noqa: E402
from pymooncake.rpc import RpcError  # noqa: E402
from pymooncake.rpc.messages import DecodeTask, SamplingOptions  # noqa: E402


def test_step_time_model_is_the_least_squares_line() -> None:
    m = StepTimeModel(window=4)
    assert m.predict_s(3) is None
    for n in (1, 2, 4, 8, 16):                        # t = 2 ms + 1 ms per sequence
        m.add(n, 0.002 + 0.001 * n)
    assert len(m) == 4                                # the oldest step fell out
    assert m.predict_s(10) == pytest.approx(0.012)
    m2 = StepTimeModel()
    for _ in range(3):
        m2.add(4, 0.01)                               # one batch size: flat line
    assert m2.predict_s(40) == pytest.approx(0.01)
    with pytest.raises(ValueError):
        StepTimeModel(window=1)


def test_step_time_model_running_sums_match_a_fresh_fit_over_the_window() -> None:
    """The model keeps its window's sums as steps come and go (O(1) a prediction); after
    thousands of steps, many evictions and re-summings, each prediction still equals a
    least-squares fit of the last ``window`` steps made from scratch (``numpy.polyfit``),
    the slope clipped at 0 as the model does."""
    import random

    import numpy as np

    rng = random.Random(7)
    m = StepTimeModel(window=64)
    seen: list[tuple[int, float]] = []
    for i in range(3000):
        n = rng.randint(1, 8)
        t = 0.001 + 0.0004 * n + rng.uniform(0, 0.0005)
        m.add(n, t)
        seen.append((n, t))
        if i % 97 == 5:
            b, y = np.array(seen[-64:], dtype=np.float64).T
            slope, icpt = np.polyfit(b, y, 1)
            slope = max(0.0, slope)
            want = y.mean() + slope * (6 - b.mean()) if slope == 0.0 else icpt + slope * 6
            assert m.predict_s(6) == pytest.approx(want, rel=1e-9)
    falling = StepTimeModel(window=8)       # bigger batches measured faster: slope clipped
    for i in range(20):
        falling.add(1 + i % 4, 0.004 - 0.0005 * (i % 4))
    assert falling.predict_s(40) == pytest.approx(0.004 - 0.0005 * 1.5, rel=1e-9)


def _worker(num_kv_blocks: int = 64, max_num_seqs: int = 4):
    from pymooncake.engine.worker.base import WorkerConfig
    from pymooncake.engine.worker.decode import DecodeWorker
    w = DecodeWorker(WorkerConfig("d0", "colocated", "127.0.0.1:1",
                                  num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs))
    w.engine = w.build_engine("colocated")
    return w


def _task(rid: str, n_prompt: int = 40, max_tokens: int = 8, tbt: float = 0.0) -> DecodeTask:
    return DecodeTask(rid, tuple([5] * n_prompt), SamplingOptions(max_tokens=max_tokens), 0,
                      tbt)


def test_admission_refuses_when_measured_steps_miss_the_tbt_slo() -> None:
    w = _worker()
    for n in range(1, 9):
        w.on_step_timed(n, 0.004 + 0.002 * n)         # measured: 6 ms … 20 ms
    # one more request → batch 1 → predicted 6 ms: within 10 ms, admitted
    assert asyncio.run(w._prepare(_task("a", tbt=0.010))) is None
    # the next one would make batch 2 → 8 ms; with a 7 ms SLO it is refused, named
    with pytest.raises(RpcError) as e:
        asyncio.run(w._prepare(_task("b", tbt=0.007)))
    assert e.value.code == "TBT_SLO" and "0.0080" in str(e.value)
    assert "b" not in w._streams                      # nothing reserved for it
    assert asyncio.run(w._prepare(_task("c", tbt=0.0))) is None   # 0 = no TBT check


def test_a_paced_worker_admits_against_its_interval_before_any_step() -> None:
    """With ``decode_step_interval_s`` the TBT is at least the interval: a request whose TBT
    SLO is tighter is refused even before 8 steps were measured; a looser one is not."""
    from pymooncake.engine.worker.base import WorkerConfig
    from pymooncake.engine.worker.decode import DecodeWorker
    w = DecodeWorker(WorkerConfig("d0", "decode", "127.0.0.1:1", num_kv_blocks=64,
                                  decode_step_interval_s=0.05))
    w.engine = w.build_engine("decode")
    with pytest.raises(RpcError) as e:
        asyncio.run(w._prepare(_task("a", tbt=0.04)))
    assert e.value.code == "TBT_SLO"
    assert "decode steps paced 0.0500 s apart" in str(e.value)
    assert "a" not in w._streams
    assert asyncio.run(w._prepare(_task("b", tbt=0.06))) is None
    for n in range(1, 9):
        w.on_step_timed(n, 0.05 + 0.01 * n)           # measured: slower than the interval
    with pytest.raises(RpcError) as e:                # batch 2 → 70 ms > 65 ms
        asyncio.run(w._prepare(_task("c", tbt=0.065)))
    assert "predicted TBT 0.0700 s at batch 2" in str(e.value)


def test_admission_counts_requests_admitted_but_not_started() -> None:
    w = _worker(num_kv_blocks=8, max_num_seqs=8)      # 8 blocks of 16 tokens
    assert asyncio.run(w._prepare(_task("a", n_prompt=40, max_tokens=24))) is None  # 4 blocks
    assert asyncio.run(w._prepare(_task("b", n_prompt=40, max_tokens=24))) is None  # 4 more
    with pytest.raises(RpcError) as e:                # the engine still shows 8 free blocks
        asyncio.run(w._prepare(_task("c", n_prompt=10, max_tokens=2)))
    assert e.value.code == "NO_KV_SPACE" and "0 free" in str(e.value)


@pytest.mark.parametrize(("hint", "cached", "n_prompt", "want"), [
    (10, 160, 200, (10, 10)),   # every hinted block was reused: nothing stale
    (10, 64, 200, (4, 10)),     # the Store lost blocks 4..9
    (-1, 0, 200, (0, 0)),       # no hint (unknown)
    (0, 0, 200, (0, 0)),        # hint: none held
    (4, 48, 64, (3, 3)),        # 64 tokens = 4 blocks; block 3 is always computed (BUG-09)
    (4, 0, 64, (0, 3)),
])
def test_stale_store_blocks_hand_cases(hint, cached, n_prompt, want) -> None:
    from pymooncake.engine.worker.prefill import stale_store_blocks
    assert stale_store_blocks(hint, cached, n_prompt, 16) == want


class _CountingStore:
    """The two StoreClient calls the loader's lookup makes, counted (unit-test fake)."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values
        self.calls = 0

    def batch_exist(self, keys):
        self.calls += 1
        return [k in self.values for k in keys]

    def batch_get(self, keys):
        self.calls += 1
        return [self.values[k] for k in keys]


def test_store_lookup_is_skipped_when_the_hint_says_local_covers_it() -> None:
    from pymooncake.engine import Engine, EngineConfig
    from pymooncake.engine.kv_loader import StoreKVLoader, store_key
    from pymooncake.engine.request import Request
    from pymooncake.engine.sampling import SamplingParams
    eng = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=32))
    ns = eng.namespace.digest()
    prompt = list(range(3, 3 + 80))                       # 5 full blocks
    req = Request("r", prompt, SamplingParams(max_tokens=1), eng.namespace)
    assert len(req.block_keys) == 5
    blob = bytes(eng.kv.block_nbytes)
    store = _CountingStore({store_key(ns, str(k)): blob for k in req.block_keys[:3]})
    loader = StoreKVLoader(store, eng.kv, ns, mode="async")  # answers once all is read
    loader.hint("r", 3)
    assert loader.get_num_matched_tokens(req, 48) == 0    # local has 3 blocks: no round trip
    assert store.calls == 0
    assert _matched(loader, req, 16) == 32                # local 1 block: the Store has 2 more
    assert store.calls == 2
    loader.forget("r")
    loader.hint("r", -1)                                  # unknown: always look
    assert _matched(loader, req, 48) == 0 and store.calls == 3
    loader.close()


def _matched(loader, req, num_local: int) -> int:
    """Asked until the loader's fetch thread has the answer (None = still loading)."""
    import time
    deadline = time.monotonic() + 10.0
    while (n := loader.get_num_matched_tokens(req, num_local)) is None:
        assert time.monotonic() < deadline, "store lookup never finished"
        time.sleep(0.002)
    return n
