"""Decode pacing (``WorkerConfig.decode_step_interval_s``, ``pymooncake decode
--decode-step-interval-s``): the engine loop of a decode worker starts a step at most every
interval while requests decode, runs the commands that come meanwhile (so a request added
during the hold is in the next step), leaves the tokens unchanged and stops at once.

The loop is the real ``EngineWorker._engine_main`` on a thread, with the real tiny engine;
commands go in through ``_cmds`` as the RPC handlers' ``on_engine`` does."""

from __future__ import annotations

import threading
import time

import pytest

from pymooncake.engine import Engine, EngineConfig, SamplingParams
from pymooncake.engine.worker.base import EngineWorker, WorkerConfig
from pymooncake.engine.worker.config import MAX_DECODE_STEP_INTERVAL_S
from tests.serving.conftest import stream_token_ids

INTERVAL = 0.2


def _config(interval: float, role: str = "decode") -> WorkerConfig:
    return WorkerConfig(instance_id="d", role=role, conductor="127.0.0.1:1",
                        decode_step_interval_s=interval)


class _Loop(EngineWorker):
    """The engine loop alone: records when each step began and who ran in it."""

    def __init__(self, interval: float) -> None:
        super().__init__(_config(interval))
        self.engine = Engine.from_model_name("tiny", EngineConfig(max_model_len=512,
                                                                   num_kv_blocks=64))
        self.steps: list[tuple[float, list[str]]] = []
        self.outputs: dict[str, list[int]] = {}
        self.holds = 0
        self.holding = False
        self.added: dict[str, tuple[float, int, bool]] = {}
        """Request id → (when its command ran, steps done by then, ran inside a hold)."""
        self.thread = threading.Thread(target=self._engine_main, daemon=True)

    def on_step_timed(self, batch_size: int, seconds: float) -> None:
        # the loop's own record of when the step began (what the hold counts from)
        self.steps.append((self._step_began,
                           [r.request_id for r in self.engine.scheduler.running]))

    def after_step(self, outputs: list) -> None:
        for o in outputs:
            self.outputs[o.request_id] = list(o.output_token_ids)

    def _hold_step(self, until: float) -> None:
        self.holds += 1
        self.holding = True
        try:
            super()._hold_step(until)
        finally:
            self.holding = False

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

        def cmd() -> None:
            self.added[rid] = (time.perf_counter(), len(self.steps), self.holding)
            self.engine.add_request(prompt, params, rid)
        self._cmds.put(cmd)

    def stop(self) -> None:
        self._stop.set()
        self._cmds.put(lambda: None)   # as serve()'s shutdown wakes the engine thread
        self.thread.join(5)


def _wait(pred, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


PROMPT_A = [(7 * i + 3) % 250 for i in range(40)]
PROMPT_B = [(11 * i + 5) % 250 for i in range(25)]


def _reference() -> dict[str, list[int]]:
    e = Engine.from_model_name("tiny", EngineConfig(max_model_len=512, num_kv_blocks=64))
    outs = e.generate([PROMPT_A, PROMPT_B], SamplingParams(max_tokens=10, ignore_eos=True))
    return {"a": list(outs[0].output_token_ids), "b": list(outs[1].output_token_ids)}


def test_paced_steps_start_an_interval_apart_and_a_request_added_meanwhile_joins_the_next():
    w = _Loop(INTERVAL)
    w.thread.start()
    try:
        w.add("a", PROMPT_A, 10)
        _wait(lambda: len(w.steps) >= 3 and w.holding)
        w.add("b", PROMPT_B, 10)      # lands while the loop holds a step (~INTERVAL long)
        _wait(lambda: len(w.outputs) == 2)
    finally:
        w.stop()
    assert not w.thread.is_alive()
    # the tokens do not depend on when the steps ran
    assert w.outputs == _reference()
    gaps = [b[0] - a[0] for a, b in zip(w.steps, w.steps[1:], strict=False)]
    assert len(gaps) >= 10
    assert min(gaps) >= INTERVAL, gaps
    # "b"'s command ran inside a hold, after `done` steps: the hold ran it at once, so "b"
    # is in the very next step (0-based index `done`), beside "a" (one step for both)
    _, done, in_hold = w.added["b"]
    assert in_hold
    joined = next(i for i, (_, ids) in enumerate(w.steps) if "b" in ids)
    assert joined == done, (done, joined)
    assert w.steps[joined][1] == ["a", "b"]


def test_unpaced_loop_never_holds_and_steps_back_to_back():
    w = _Loop(0.0)
    w.thread.start()
    try:
        w.add("a", PROMPT_A, 10)
        _wait(lambda: "a" in w.outputs)
    finally:
        w.stop()
    assert w.holds == 0
    assert w.outputs["a"] == _reference()["a"]
    assert len(w.steps) == 10   # one prefill step (its first token) + 9 decode steps
    # ten steps of the tiny model in far less than the ten intervals pacing would take
    assert w.steps[-1][0] - w.steps[0][0] < 9 * INTERVAL


def test_first_step_after_idle_is_not_held():
    """A request that comes to an idle worker runs at once, even right after the last
    request's final step (within what would be the interval), and so does one added during
    a hold whose last running request was aborted meanwhile (the hold ends with the work)."""
    w = _Loop(INTERVAL)
    w.thread.start()
    try:
        w.add("a", PROMPT_A, 3)
        _wait(lambda: "a" in w.outputs)
        w.add("c", PROMPT_B, 2)       # well inside INTERVAL after "a"'s last step
        _wait(lambda: "c" in w.outputs)
        w.add("d", PROMPT_A, 50)
        _wait(lambda: w.holding)
        w._cmds.put(lambda: w.engine.abort("d"))   # the hold now has nothing to wait for
        w.add("e", PROMPT_B, 2)       # queued behind the abort, ~INTERVAL before the hold ends
        _wait(lambda: "e" in w.outputs)
    finally:
        w.stop()
    for rid in ("c", "e"):
        ran_at = w.added[rid][0]
        first = next(t for t, ids in w.steps if rid in ids)
        assert first - ran_at < INTERVAL / 2, (rid, first - ran_at)


def test_stop_during_a_hold_returns_at_once():
    w = _Loop(5.0)
    w.thread.start()
    try:
        w.add("a", PROMPT_A, 100)
        _wait(lambda: len(w.steps) >= 1)
        time.sleep(0.05)                  # the loop is now holding for ~5 s
    finally:
        t0 = time.monotonic()
        w.stop()
    assert not w.thread.is_alive()
    assert time.monotonic() - t0 < 2.0
    assert len(w.steps) == 1


@pytest.mark.parametrize("value", [-0.01, MAX_DECODE_STEP_INTERVAL_S + 1, float("nan")])
def test_bad_intervals_are_refused_naming_the_flag(value: float) -> None:
    with pytest.raises(ValueError, match="--decode-step-interval-s must be in"):
        _config(value)


@pytest.mark.parametrize("role", ["prefill", "colocated"])
def test_only_decode_workers_take_an_interval(role: str) -> None:
    with pytest.raises(ValueError, match="decode workers only"):
        _config(INTERVAL, role)
    assert _config(0.0, role).decode_step_interval_s == 0.0


def test_a_paced_pd_cluster_spaces_the_tokens_and_keeps_them_exact(make_cluster):
    """Real processes: ``ClusterSpec.decode_step_interval_s`` reaches the decode worker
    (``--decode-step-interval-s``). A request alone on it gets its first token from the prefill
    worker and the next seven from seven decode steps: the first of those runs at once,
    each later one at least the interval after the one before, so the last token comes at
    least 6 intervals after the second (less the frames' jitter). Unpaced, the seven tiny
    steps take milliseconds. The tokens equal one engine's greedy output."""
    interval = 0.1
    c = make_cluster(num_prefill=1, num_decode=1, max_model_len=512, num_kv_blocks=64,
                     decode_step_interval_s=interval)
    times: list[float] = []
    ids, _, errors = stream_token_ids(c.url, PROMPT_A, 8, arrivals=times, ignore_eos=True)
    assert not errors
    ref = Engine.from_model_name("tiny", EngineConfig(max_model_len=512, num_kv_blocks=64)
                                 ).generate([PROMPT_A], SamplingParams(max_tokens=8,
                                                                       ignore_eos=True))
    assert ids == list(ref[0].output_token_ids)
    assert times[-1] - times[1] >= 6 * interval - 0.05, [t - times[0] for t in times]


def test_serve_and_bench_serving_hand_the_interval_to_the_decode_workers(monkeypatch):
    """The flag reaches ``ClusterSpec`` from ``serve`` and, for the P/D configs only, from
    ``bench serving`` (the cluster itself is not started here)."""
    import signal

    from pymooncake.cli import bench_serving, serve
    from pymooncake.cli.main import main
    specs = []

    class _NoCluster:
        def __init__(self, spec) -> None:
            specs.append(spec)

        def start(self) -> None:
            raise RuntimeError("not started in this test")

        def stop(self) -> None:
            pass

    monkeypatch.setattr(bench_serving, "LocalCluster", _NoCluster)
    monkeypatch.setattr(serve, "LocalCluster", _NoCluster)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    assert main(["bench", "serving", "--configs", "global-cache", "--decode-step-interval-s",
                 "0.08"]) == 1
    assert main(["bench", "serving", "--configs", "colocated-cache,global-cache",
                 "--repeats", "1", "--decode-step-interval-s", "0.04"]) == 1
    assert main(["serve", "--model", "tiny", "--decode-step-interval-s", "0.05"]) == 1
    assert [(s.colocated, s.decode_step_interval_s) for s in specs] == [
        (False, 0.08), (True, 0.0), (False, 0.05)]
