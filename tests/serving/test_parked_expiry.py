"""A finished ``target_follows`` prefill whose ``SetTarget`` never comes fails with
``KV_TARGET_MISSING`` after ``PARKED_MAX_S`` even when the worker has nothing else to
compute (``PrefillWorker.on_idle``): before, only a later engine step expired it, so an idle
worker kept the request (and its caller) waiting for good."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pymooncake.engine.worker import prefill as prefill_mod
from pymooncake.engine.worker.base import WorkerConfig
from pymooncake.engine.worker.prefill import PrefillWorker, _Pending
from pymooncake.rpc import RpcError
from pymooncake.rpc.messages import PrefillTask, SamplingOptions


def _worker() -> PrefillWorker:
    return PrefillWorker(WorkerConfig(instance_id="p", role="prefill",
                                      conductor="127.0.0.1:1", model="tiny"))


def _park(w: PrefillWorker, loop: asyncio.AbstractEventLoop, rid: str, age_s: float) -> Any:
    task = PrefillTask(rid, (1, 2, 3), SamplingOptions(max_tokens=1), target_follows=True)
    p = _Pending(task, loop.create_future())
    w._parked[rid] = (time.monotonic() - age_s, p, None, (), ())  # no blocks pinned
    return p.future


def test_idle_turn_expires_a_parked_prefill_past_its_limit_and_keeps_a_young_one() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        w = _worker()
        w.loop = loop
        old = _park(w, loop, "old", prefill_mod.PARKED_MAX_S + 1.0)
        young = _park(w, loop, "young", 1.0)
        w.on_idle()                       # what the engine thread does on an idle turn
        await asyncio.sleep(0.05)         # the posted failure runs on the loop
        assert old.done()
        with pytest.raises(RpcError) as e:
            old.result()
        assert e.value.code == "KV_TARGET_MISSING"
        assert not young.done()
        assert set(w._parked) == {"young"}
    asyncio.run(main())
