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
    """A stand-in subject. ``times(i)``: the (made-up) seconds of its ``i``-th round of all
    subjects' rounds so far (``calls``, shared); ``child_step``: CPU its child spends per
    own round; ``spin``: CPU its child spends per round of any subject."""

    def __init__(self, name: str, log: list[str], times=None, child_step: float = 0.0,  # noqa: ANN001
                 spin: float = 0.0, calls: list[int] | None = None) -> None:
        self.name, self.log, self.times = name, log, times or (lambda i: 1e-3)
        self.bytes_per_round = 1
        self._child, self.child_step, self.spin = 0.0, child_step, spin
        self.calls = calls if calls is not None else [0]
        self.checks = 0

    def round(self) -> tuple[float, float]:
        self.log.append(self.name)
        self.calls[0] += 1
        self._child += self.child_step
        t = self.times(self.calls[0])
        return t, t

    def child_cpu_s(self) -> float:
        return self._child + self.spin * self.calls[0]

    def check(self) -> bool:
        self.checks += 1
        return self.checks != 2     # the second repeat's read-back is wrong


def test_rounds_alternate_forwards_and_backwards_and_rotate_with_the_repeat() -> None:
    log: list[str] = []
    subs = [_Fake("a", log), _Fake("b", log), _Fake("c", log)]
    got = measure_rounds(subs, 0.0, rotation=0, min_cycles=4)
    assert log == ["a", "b", "c", "c", "b", "a"] * 2
    assert {n: v[2] for n, v in got.items()} == {"a": 4, "b": 4, "c": 4}
    log.clear()
    measure_rounds(subs, 0.0, rotation=1, min_cycles=2)
    assert log == ["b", "c", "a", "a", "c", "b"]
    log.clear()
    measure_rounds(subs, 0.0, rotation=5, min_cycles=1)    # 5 mod 3
    assert log == ["c", "a", "b"]


def test_a_repeat_runs_min_time_times_the_subjects_and_at_most_max_cycles() -> None:
    log: list[str] = []

    class Slow(_Fake):
        def round(self) -> tuple[float, float]:
            time.sleep(0.002)
            return super().round()

    subs = [Slow("a", log), Slow("b", log)]
    t0 = time.perf_counter()
    got = measure_rounds(subs, 0.05, min_cycles=1)
    assert time.perf_counter() - t0 >= 0.1          # 0.05 s x 2 subjects
    assert got["a"][2] == got["b"][2] >= 2          # as many rounds each
    log.clear()
    assert measure_rounds(subs, 10.0, min_cycles=1, max_cycles=3)["a"][2] == 3


def test_cpu_counts_each_childs_whole_repeat_and_the_parent_only_where_it_works() -> None:
    log: list[str] = []
    calls = [0]
    a = _Fake("a", log, child_step=0.25, calls=calls)
    b = _Fake("b", log, spin=0.1, calls=calls)     # its child spins through a's rounds too
    c = _Fake("c", log, calls=calls)

    def busy() -> tuple[float, float]:              # 20 ms of this process's CPU a round
        t = time.process_time()
        while time.process_time() - t < 0.02:
            pass
        return 1e-3, 0.0

    c.round, c.parent_cpu = busy, False
    got = measure_rounds([a, b, c], 0.0, min_cycles=4)
    assert got["a"][3] == pytest.approx(1.0, abs=0.01)     # 4 rounds x 0.25
    assert got["b"][3] == pytest.approx(0.8, abs=0.01)     # 8 rounds of a and b x 0.1
    assert got["c"][3] == pytest.approx(0.0, abs=0.01)     # parent CPU not its own


def test_every_repeat_is_checked() -> None:
    log: list[str] = []
    a = _Fake("a", log)
    assert [measure_rounds([a], 0.0, min_cycles=1)["a"][4] for _ in range(3)] == [
        True, False, True]


def test_a_swing_in_speed_hits_both_subjects_alike() -> None:
    """Two equal subjects; a third of the way into the repeat every round gets 3x slower
    (another VM takes the memory bus). Taken in turn, both have most of their rounds in
    the slow spell and their medians agree; measured one after the other (the old
    harness), the first would be median-fast and the second slow: a 3x "difference"."""
    log: list[str] = []
    calls = [0]
    times = lambda i: 3e-3 if i > 20 else 1e-3  # noqa: E731 - 60 rounds in all
    subs = [_Fake("a", log, times, calls=calls), _Fake("b", log, times, calls=calls)]
    got = measure_rounds(subs, 0.0, min_cycles=30, max_cycles=30)
    assert got["a"][0] == got["b"][0] == 3e-3


def test_a_failing_mooncake_is_reported_and_the_others_go_on(monkeypatch) -> None:  # noqa: ANN001
    from pymooncake.bench import transfer
    from pymooncake.bench.transfer_subjects import MooncakeFailed

    log: list[str] = []

    def fake(name: str):  # noqa: ANN202
        def make(*a, **k) -> _Fake:  # noqa: ANN002, ANN003
            f = _Fake(name, log)
            f.check = lambda: True
            return f
        return make

    class BadMooncake(_Fake):
        def __init__(self, *a, **k) -> None:  # noqa: ANN002, ANN003
            super().__init__("mooncake", log)

        def round(self) -> tuple[float, float]:
            if self.calls[0] >= 5:
                raise MooncakeFailed("initiator died")
            return super().round()

    for n, cls in (("Ours", "pymooncake"), ("Memcpy", "memcpy"), ("Sockets", "socket")):
        monkeypatch.setattr(transfer, n, fake(cls))
    monkeypatch.setattr(transfer, "Mooncake", BadMooncake)
    monkeypatch.setattr(transfer, "mooncake_available", lambda p: (True, "stand-in"))
    r = transfer.run("tcp", 4096, 2, 1, min_time_s=0.0, repeat=3)
    assert "mooncake run failed" in r.mooncake_note and "initiator died" in r.mooncake_note
    assert r.figures["pymooncake"]["n"] == r.figures["socket"]["n"] == 3
    assert r.figures["mooncake"]["n"] == 1          # the one repeat it finished
    assert "mooncake" not in r.ratios and r.verified is True


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
        assert m.check() is True
        assert m.check() is False       # cleared: nothing read back since
    finally:
        m.close()
    assert m.proc.poll() is not None
