"""``StepTimeModel``: a decode worker's measured step time as a line in the batch size, the
TBT its running requests see; decode admission re-checks the TBT SLO with it
(``worker.decode.DecodeWorker._prepare``). Pure: no I/O, no engine."""

from __future__ import annotations

import threading
from collections import deque


class StepTimeModel:
    """This worker's measured decode step time as a line in the batch size, ``t(n) = a +
    b·n`` (least squares over the last ``window`` steps; seconds). It is what the running
    requests see as their TBT, so admission can re-check the TBT SLO with the hardware's
    real speed rather than the Conductor's estimate. No I/O: steps are ``add``-ed (by the
    engine thread) while admission predicts (on the event loop), so both go under a lock.
    The window's sums are kept as steps come and go, so a prediction is O(1), not a pass
    over the window (issue 16: that pass was most of a decode admission's CPU); they are
    summed afresh every ``window`` steps, so float rounding cannot pile up.
    """

    def __init__(self, window: int = 256) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2 steps, got {window}")
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._sums = [0, 0.0, 0, 0.0]   # Σb, Σt, Σb², Σb·t over the window
        self._until_resum = window

    def add(self, batch_size: int, seconds: float) -> None:
        if batch_size > 0 and seconds >= 0:
            with self._lock:
                steps, sums = self._steps, self._sums
                if len(steps) == steps.maxlen:
                    b, t = steps[0]
                    sums[0] -= b
                    sums[1] -= t
                    sums[2] -= b * b
                    sums[3] -= b * t
                steps.append((batch_size, seconds))
                self._until_resum -= 1
                if self._until_resum <= 0:
                    self._until_resum = steps.maxlen or 0
                    sums[:] = [sum(b for b, _ in steps), sum(t for _, t in steps),
                               sum(b * b for b, _ in steps), sum(b * t for b, t in steps)]
                else:
                    sums[0] += batch_size
                    sums[1] += seconds
                    sums[2] += batch_size * batch_size
                    sums[3] += batch_size * seconds

    def __len__(self) -> int:
        return len(self._steps)

    def predict_s(self, batch_size: int) -> float | None:
        """Predicted step time at ``batch_size``; None before any step was measured."""
        with self._lock:
            n = len(self._steps)
            sb, st, sbb, sbt = self._sums
        if not n:
            return None
        mx, my = sb / n, st / n
        sxx = sbb - sb * mx             # Σ(b - mx)² (0 when every b is the same)
        slope = 0.0
        if sxx > 0:
            slope = max(0.0, (sbt - sb * my) / sxx)
        return max(0.0, my + slope * (batch_size - mx))
