"""`bench transfer` alternates single rounds of its subjects (issue 16: figures that a host's
swings in bandwidth hit alike). Unit tests with stand-in subjects, plus the Mooncake
initiator's round protocol when the wheel's interpreter is at hand."""

from __future__ import annotations

import os
import time

import pytest

from pymooncake.bench.transfer import measure_rounds
from pymooncake.bench.transfer_subjects import Subject


class _Fake(Subject):
    def __init__(self, name: str, log: list[str], cost_s=None, child_step: float = 0.0):  # noqa: ANN001
        self.name, self.log, self.cost_s = name, log, cost_s or (lambda: 0.0)
        self.bytes_per_round = 1
        self._child, self.child_step = 0.0, child_step

    def round(self) -> tuple[float, float]:
        self.log.append(self.name)
        self._child += self.child_step
        t0 = time.perf_counter()
        time.sleep(self.cost_s())
        return time.perf_counter() - t0, 0.0

    def child_cpu_s(self) -> float:
        return self._child


def test_rounds_alternate_and_the_order_rotates_with_the_repeat() -> None:
    log: list[str] = []
    subs = [_Fake("a", log), _Fake("b", log), _Fake("c", log)]
    got = measure_rounds(subs, 0.0, rotation=0, min_cycles=4)
    assert log == ["a", "b", "c"] * 4
    assert {n: v[2] for n, v in got.items()} == {"a": 4, "b": 4, "c": 4}
    log.clear()
    measure_rounds(subs, 0.0, rotation=1, min_cycles=2)
    assert log == ["b", "c", "a"] * 2
    log.clear()
    measure_rounds(subs, 0.0, rotation=5, min_cycles=1)    # 5 mod 3
    assert log == ["c", "a", "b"]


def test_a_repeat_lasts_min_time_per_subject_and_at_most_max_cycles() -> None:
    log: list[str] = []
    subs = [_Fake("a", log, lambda: 0.002), _Fake("b", log, lambda: 0.002)]
    t0 = time.perf_counter()
    got = measure_rounds(subs, 0.05, min_cycles=1)
    assert time.perf_counter() - t0 >= 0.1          # 0.05 s x 2 subjects
    assert got["a"][2] == got["b"][2] >= 10         # ~25 cycles of ~4 ms; sleep jitter
    log.clear()
    assert measure_rounds(subs, 10.0, min_cycles=1, max_cycles=3)["a"][2] == 3


def test_cpu_counts_the_children_of_each_subject_during_its_own_rounds() -> None:
    log: list[str] = []
    subs = [_Fake("a", log, child_step=0.25), _Fake("b", log, child_step=0.0)]
    got = measure_rounds(subs, 0.0, min_cycles=4)
    # a's child CPU rises by 0.25 s a round; this process adds microseconds
    assert got["a"][3] == pytest.approx(1.0, abs=0.01)
    assert got["b"][3] == pytest.approx(0.0, abs=0.01)


def test_a_swing_in_speed_hits_both_subjects_alike() -> None:
    """Two equal subjects; 30 % into the repeat everything gets 3x slower (another VM
    takes the memory bus). Taken in turn, both see the slow spell in most of their rounds
    and their medians agree; measured one block after the other (the old harness), the
    first would be median-fast and the second slow, a 3x "difference"."""
    log: list[str] = []
    window = 0.2
    start = time.perf_counter()

    def cost() -> float:
        return 0.003 * (3 if time.perf_counter() - start > 0.3 * window else 1)

    subs = [_Fake("a", log, cost), _Fake("b", log, cost)]
    got = measure_rounds(subs, window / 2, min_cycles=1)
    assert got["a"][0] / got["b"][0] == pytest.approx(1.0, abs=0.25)


MOONCAKE_PYTHON = os.environ.get("PYMOONCAKE_MOONCAKE_PYTHON", "")


@pytest.mark.integration
@pytest.mark.skipif(not MOONCAKE_PYTHON, reason="set PYMOONCAKE_MOONCAKE_PYTHON to the "
                    "interpreter of a venv with mooncake-transfer-engine-non-cuda")
def test_mooncake_initiator_answers_round_by_round() -> None:
    from pymooncake.bench.transfer import mooncake_available
    from pymooncake.bench.transfer_subjects import Mooncake

    ok, note = mooncake_available(MOONCAKE_PYTHON)
    if not ok:
        pytest.skip(note)
    m = Mooncake(MOONCAKE_PYTHON, 65536, 4)
    try:
        cpu0 = m.child_cpu_s()
        rounds = [m.round() for _ in range(3)]
        assert all(w > 0 and r > 0 for w, r in rounds)
        assert m.child_cpu_s() > cpu0 > 0
        assert m.verified() is True
    finally:
        m.close()
    assert m.proc.poll() is not None
