"""``pymooncake bench sim``: the simulator's wall time and peak memory on the conversation
trace (8P8D, global store), side by side with NVIDIA Dynamo's offline trace replay when the
``ai-dynamo`` package is installed. Each tool runs in its own child process; its peak RSS is
that child's ``ru_maxrss`` (``os.wait4``)."""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_SIM_CHILD = (
    "import sys\n"
    "from pymooncake.sim.config import SimConfig\n"
    "from pymooncake.sim.runner import simulate\n"
    "from pymooncake.workload.trace import load_trace\n"
    "res = simulate(load_trace(sys.argv[1]), SimConfig(scenario='pd-global',"
    " scheduler='global-cache', num_prefill=8, num_decode=8))\n"
    "print(len(res.requests))\n")


def _run_child(argv: list[str]) -> tuple[float, int, int, str]:
    """(wall s, peak RSS bytes, exit status, stderr tail) of one child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert p.stderr is not None
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    return wall, ru.ru_maxrss * 1024, p.returncode, err.decode(errors="replace")[-400:]


def dynamo_argv(trace: str, python: str) -> list[str]:
    """The issue's Dynamo command line (8 prefill + 8 decode workers, KV router)."""
    return [python, "-m", "dynamo.replay", trace, "--num-prefill-workers", "8",
            "--num-decode-workers", "8", "--replay-mode", "offline", "--router-mode",
            "kv_router", "--trace-block-size", "512",
            "--prefill-engine-args",
            '{"worker_type":"prefill","block_size":512,"num_gpu_blocks":2048}',
            "--decode-engine-args",
            '{"worker_type":"decode","block_size":512,"num_gpu_blocks":2048}']


def _has_dynamo(python: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec("dynamo") is not None
    try:
        return subprocess.run([python, "-c", "import dynamo.replay"], capture_output=True,
                              timeout=120, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_bench(trace: str | Path, *, with_dynamo: bool = True, repeat: int = 1,
              dynamo_python: str | None = None) -> dict[str, Any]:
    """Run both tools ``repeat`` times (alternating) and report medians and ratios.

    ``dynamo_python``: the interpreter that has ``ai-dynamo`` (default: this one, or
    ``$PYMOONCAKE_DYNAMO_PYTHON``). Dynamo 1.4.2 pins pydantic older than the project's, so it
    is best kept in its own virtual environment.

    Raises ``ValueError`` for a missing trace or ``repeat < 1``.
    """
    dynamo_python = dynamo_python or os.environ.get("PYMOONCAKE_DYNAMO_PYTHON") or sys.executable
    trace = str(trace)
    if not Path(trace).exists():
        raise ValueError(f"{trace}: no such trace file")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    have_dynamo = with_dynamo and _has_dynamo(dynamo_python)
    sims, dyns = [], []
    note = None
    for _ in range(repeat):
        wall, rss, rc, err = _run_child([sys.executable, "-c", _SIM_CHILD, trace])
        if rc != 0:
            raise ValueError(f"simulator child failed ({rc}): {err}")
        sims.append((wall, rss))
        if have_dynamo:
            wall, rss, rc, err = _run_child(dynamo_argv(trace, dynamo_python))
            if rc != 0:
                note = f"dynamo.replay failed with status {rc}: {err.strip()}"
                have_dynamo = False
            else:
                dyns.append((wall, rss))
    if not with_dynamo:
        note = "Dynamo comparison skipped (--no-dynamo)"
    elif not dyns and note is None:
        note = (f"ai-dynamo is not importable by {dynamo_python} (pip install "
                "ai-dynamo==1.4.2 into a venv and pass --dynamo-python)")
    out: dict[str, Any] = {
        "trace": trace, "repeat": repeat, "config": "pd-global, global-cache, 8P8D, A800",
        "wall_s": statistics.median(w for w, _ in sims),
        "peak_rss_bytes": int(statistics.median(r for _, r in sims)),
        "dynamo_wall_s": statistics.median(w for w, _ in dyns) if dyns else None,
        "dynamo_peak_rss_bytes": int(statistics.median(r for _, r in dyns)) if dyns else None,
    }
    out["wall_ratio"] = (out["wall_s"] / out["dynamo_wall_s"]) if dyns else None
    out["rss_ratio"] = (out["peak_rss_bytes"] / out["dynamo_peak_rss_bytes"]) if dyns else None
    if note:
        out["note"] = note
    return out
