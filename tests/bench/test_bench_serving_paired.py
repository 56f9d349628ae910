"""``bench serving --paired K``: the clusters take the trace's slices in turn, and their
reports merge into one (issue 16: a slow minute of a shared host hits both alike)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from pymooncake.cli import bench_serving_paired as bsp


def _slice(served: int, ttft: float, toks: int, tbt: float, cpu: dict[str, float],
           prompt: int = 100, cached: int = 10) -> dict:
    return {"num_requests": served, "num_served": served, "num_rejected": 0, "num_failed": 0,
            "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": toks,
            "wall_s": 1.0, "ttft_mean_s": ttft, "tbt_mean_s": tbt,
            "cluster_cpu_s": {"total": sum(cpu.values()), **cpu}}


def test_slices_merge_into_one_report() -> None:
    m = bsp.merge([_slice(2, 0.1, 10, 0.01, {"a": 1.0, "b": 0.5}),
                   _slice(6, 0.3, 30, 0.05, {"a": 2.0, "b": 0.25}, prompt=300, cached=90)])
    assert m["num_served"] == 8 and m["completion_tokens"] == 40 and m["wall_s"] == 2.0
    assert m["ttft_mean_s"] == pytest.approx((2 * 0.1 + 6 * 0.3) / 8)
    assert m["tbt_mean_s"] == pytest.approx((10 * 0.01 + 30 * 0.05) / 40)
    assert m["token_hit_ratio"] == pytest.approx(100 / 400)
    assert m["cluster_cpu_s"] == {"total": 3.75, "a": 3.0, "b": 0.75}
    assert m["slice_cpu_s"] == [1.5, 2.25]


def test_clusters_take_the_slices_in_turn_and_ratios_come_per_slice(monkeypatch) -> None:  # noqa: ANN001
    log: list[tuple[str, int, int]] = []
    cpu = {"pd": 0.0, "co": 0.0}

    class Cluster:
        def __init__(self, spec: str) -> None:
            self.url, self.name = spec, spec

        def start(self) -> None:
            pass

        def stop(self) -> None:
            log.append((self.name, -1, -1))

        def cpu_seconds(self) -> dict[str, float]:
            return {"w": cpu[self.name]}

    def run(argv: list[str], **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
        url = argv[argv.index("--url") + 1]
        lo, hi = int(argv[argv.index("--skip") + 1]), int(argv[argv.index("--limit") + 1])
        log.append((url, lo, hi))
        cpu[url] += (hi - lo) * (1.1 if url == "pd" else 1.0)
        return subprocess.CompletedProcess(argv, 0, json.dumps(_slice(hi - lo, 0.1, 5, 0.01,
                                                                      {})), "")

    monkeypatch.setattr(bsp, "LocalCluster", Cluster)
    monkeypatch.setattr(bsp, "cluster_spec", lambda name, args: name)
    monkeypatch.setattr(bsp.subprocess, "run", run)
    args = argparse.Namespace(paired=4, limit=10, time_scale=1.0, length_scale=32,
                              ttft_slo=5.0, tbt_slo=0.5)
    out = bsp.run_paired(["pd", "co"], args)
    assert log[:8] == [("pd", 0, 2), ("co", 0, 2), ("co", 2, 5), ("pd", 2, 5),
                       ("pd", 5, 7), ("co", 5, 7), ("co", 7, 10), ("pd", 7, 10)]
    assert {x[0] for x in log[8:]} == {"pd", "co"}           # both stopped
    p = out["paired"]["pd/co"]
    assert p["ratio"] == pytest.approx(1.1)
    assert p["slice_ratios"] == pytest.approx([1.1] * 4)
    assert out["results"]["pd"]["num_served"] == 10


@pytest.mark.parametrize(("flags", "named"), [
    (["--paired", "-1"], "--paired must be in [0, --limit], got -1"),
    (["--paired", "400"], "--paired must be in [0, --limit], got 400"),
    (["--paired", "3", "--repeats", "2"], "use --repeats 1 with it"),
])
def test_bad_paired_flags_are_refused(flags: list[str], named: str) -> None:
    out = subprocess.run([sys.executable, "-m", "pymooncake", "bench", "serving",
                          "--configs", "global-cache,colocated-cache", *flags],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and named in out.stderr, out.stderr


@pytest.mark.integration
def test_a_paired_replay_on_real_clusters() -> None:
    out = subprocess.run([sys.executable, "-m", "pymooncake", "bench", "serving",
                          "--configs", "global-cache,colocated-cache", "--limit", "12",
                          "--paired", "2", "--json"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    p = d["paired"]["global-cache/colocated-cache"]
    assert d["paired"]["bounds"] == [0, 6, 12] and len(p["slice_ratios"]) == 2
    for r in d["results"].values():
        assert r["num_requests"] == 12 and r["num_served"] == 12
        assert len(r["slice_cpu_s"]) == 2 and r["cluster_cpu_s"]["total"] > 0
    g, c = (d["results"][n]["cluster_cpu_s"]["total"] for n in ("global-cache",
                                                                   "colocated-cache"))
    assert p["ratio"] == pytest.approx(g / c)
