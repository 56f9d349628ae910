"""The Store fetch thread's pacing (``kv_pacing.LoadPacer``): it sleeps its share only
while the engine steps a batch that waits for no load, and wakes the moment the engine
starts waiting for a load."""

from __future__ import annotations

import threading
import time

import pytest

from pymooncake.engine.kv_pacing import LoadPacer


def test_no_sleep_without_a_running_batch_or_unpaced() -> None:
    p = LoadPacer(0.1)
    p.after_slice(0.5)  # no batch step yet: the engine is idle or waits for the load
    q = LoadPacer(1.0)
    q.batch_step()
    q.after_slice(0.5)  # share 1: never paced
    assert p.paced_s == 0.0 and q.paced_s == 0.0


def test_sleeps_its_share_while_a_batch_steps() -> None:
    p = LoadPacer(0.5, hold_s=10.0)
    p.batch_step()
    p.after_slice(0.02)  # 20 ms of work at a 50 % share: 20 ms of sleep
    assert 0.015 <= p.paced_s < 1.0


def test_engine_waiting_for_a_load_cuts_the_sleep_short() -> None:
    p = LoadPacer(0.01, hold_s=10.0)
    p.batch_step()
    t = threading.Thread(target=p.after_slice, args=(1.0,))  # would sleep 99 s
    t.start()
    time.sleep(0.05)
    p.engine_waits()
    t.join(10.0)
    assert not t.is_alive() and p.paced_s < 10.0


def test_pacing_ends_when_batch_steps_stop() -> None:
    p = LoadPacer(0.1, hold_s=0.0)
    p.batch_step()  # held 0 s: already over
    p.after_slice(1.0)
    assert p.paced_s == 0.0


@pytest.mark.parametrize("share", [0, -0.5, 1.5])
def test_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="load share"):
        LoadPacer(share)


def test_active_only_while_a_batch_steps() -> None:
    p = LoadPacer(0.1, hold_s=10.0)
    assert not p.active()
    p.batch_step()
    assert p.active()
    p.engine_waits()
    assert not p.active() and not LoadPacer(1.0).active()


def test_the_loader_paces_for_decode_steps_only() -> None:
    """``StoreKVLoader.start_step``: a step with a decoding sequence (one new token after
    computed ones) turns pacing on; prefills only, or a step that loads, leave it off."""
    from types import SimpleNamespace

    from pymooncake.engine.hooks import KVLoad, ScheduledSeq, StepContext
    from pymooncake.engine.kv_loader import StoreKVLoader

    def step(*seqs: tuple[int, int], loads: tuple[KVLoad, ...] = ()) -> bool:
        fake = SimpleNamespace(pacer=LoadPacer(0.1, hold_s=10.0), _fetches={},
                               _step_imports=[])
        ctx = StepContext(1, tuple(ScheduledSeq(f"r{i}", (0,), c, n)
                                   for i, (c, n) in enumerate(seqs)), loads)
        StoreKVLoader.start_step(fake, ctx, SimpleNamespace(block_size=16))  # type: ignore[arg-type]
        return fake.pacer.active()

    assert step((40, 1), (0, 512))  # one request decodes beside a prefill
    assert not step((0, 512), (512, 256))  # prefill chunks only
    assert not step((0, 1))  # a one-token prompt's prefill, not a decode
    assert not step()
    assert not step((40, 1), loads=(KVLoad("x", (3,), (), 0, 16),))  # the engine waits
