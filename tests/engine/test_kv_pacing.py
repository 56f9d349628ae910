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
