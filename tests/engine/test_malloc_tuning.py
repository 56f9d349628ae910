"""``engine.malloc_tuning.tune_malloc``: freed activation memory stays in the process.

Each case runs in a fresh interpreter (``mallopt`` settings are process-wide and the
default case needs glibc untouched). The workload is an engine thread's: a non-main
thread (one torch thread) allocating, filling and freeing three float32 tensors of
20-27 MiB a step, sizes changing every step — more than one 64 MiB heap of the thread's
arena, as a prefill step's activations can be. The page faults the process takes after
a warm-up are the figure: with glibc's defaults the emptied extra heap is unmapped after
every step and zero-filled again in the next; tuned, the warm thread reuses it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from pymooncake.engine.malloc_tuning import USER_SETTINGS

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt settings and RUSAGE_THREAD are glibc/Linux")

_WORKLOAD = """
import json, resource, threading
import torch
torch.set_num_threads(1)   # the faults counted are the process's; one thread fills
from pymooncake.engine.malloc_tuning import tune_malloc
tuned = tune_malloc()
again = tune_malloc()
out = {}
def work():
    for i in range(40):
        if i == 10:  # warm-up done: glibc's adaptive thresholds have settled
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ts = [torch.empty((20 + (i + j) % 8) << 18).fill_(1.0) for j in range(3)]
        del ts
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
th = threading.Thread(target=work)
th.start()
th.join()
print(json.dumps({"tuned": tuned, "again": again, "faults": out["faults"]}))
"""


def _run(switch: str | None, **extra: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items()
           if k != "PYMOONCAKE_MALLOC_TUNING" and k not in USER_SETTINGS}
    if switch is not None:
        env["PYMOONCAKE_MALLOC_TUNING"] = switch
    env.update(extra)
    r = subprocess.run([sys.executable, "-c", _WORKLOAD], capture_output=True, text=True,
                       env=env, timeout=120, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_tuned_process_reuses_freed_activation_memory() -> None:
    default = _run("0")
    tuned = _run(None)
    assert default["tuned"] is False and default["again"] is False   # the off-switch
    assert tuned["tuned"] is True and tuned["again"] is True          # applied, once
    # 30 steps of ~70 MiB: with glibc's defaults the second heap's ~6-20 MiB is mapped and
    # zero-filled again every step (about 128 k faults measured); tuned, next to none.
    assert default["faults"] >= 30_000, default
    assert tuned["faults"] <= default["faults"] // 20, (tuned, default)


@pytest.mark.parametrize("switch", ["off", "false", "NO"])
def test_off_switch_spellings_leave_glibc_defaults(switch: str) -> None:
    assert _run(switch)["tuned"] is False


@pytest.mark.parametrize("name,value", [("MALLOC_TRIM_THRESHOLD_", "131072"),
                                        ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")])
def test_user_malloc_settings_are_left_alone(name: str, value: str) -> None:
    assert _run(None, **{name: value})["tuned"] is False


def test_unrelated_glibc_tunables_do_not_stop_it() -> None:
    assert _run(None, GLIBC_TUNABLES="glibc.pthread.rseq=0")["tuned"] is True
