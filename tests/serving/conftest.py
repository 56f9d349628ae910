"""Real clusters for the serving tests: ``pymooncake`` master, Conductor and workers as
separate processes on 127.0.0.1 (``cli.cluster.LocalCluster``), one per test module, always
stopped (every child killed) in the fixture's finalizer."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pymooncake.cli.cluster import ClusterSpec, LocalCluster


@pytest.fixture(scope="module")
def make_cluster() -> Iterator[Any]:
    clusters: list[LocalCluster] = []

    def make(**kw: Any) -> LocalCluster:
        kw.setdefault("port", 0)
        kw.setdefault("quiet", True)
        c = LocalCluster(ClusterSpec(**kw))
        clusters.append(c)
        c.start()
        return c

    try:
        yield make
    finally:
        for c in clusters:
            c.stop()
        for c in clusters:
            for name, p in c.procs.items():
                assert p.poll() is not None, f"{name} still running after stop()"


def health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=10).json()


def workers(url: str) -> dict[str, dict[str, Any]]:
    return {w["instance_id"]: w for w in health(url)["workers"]}


def wait_for(pred: Any, timeout_s: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached in {timeout_s} s")


def complete(url: str, prompt: Any, max_tokens: int = 8, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def stream_token_ids(url: str, prompt: list[int], max_tokens: int, *,
                     arrivals: list[float] | None = None, **extra: Any
                     ) -> tuple[list[int], dict[str, Any] | None, list[dict[str, Any]]]:
    """Stream a completion with ``return_token_ids``: (token ids, usage, error events).
    ``arrivals``, when given, gets one ``time.perf_counter()`` per token: when its chunk
    arrived."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **extra}
    ids: list[int] = []
    usage = None
    errors = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                got = ch.get("token_ids") or []
                ids.extend(got)
                if arrivals is not None:
                    arrivals.extend([time.perf_counter()] * len(got))
    return ids, usage, errors


def wait_store_blocks(url: str, at_least: int, timeout_s: float = 10.0) -> int:
    """Wait until the Conductor has seen the Store hold ``at_least`` blocks (prefill workers
    put blocks off the TTFT path and report them as KV events)."""
    return wait_for(lambda: (lambda n: n if n >= at_least else None)(
        health(url)["num_store_blocks"]), timeout_s, f"{at_least} blocks in the Store")


def settled_store_blocks(url: str, quiet_s: float = 0.4, timeout_s: float = 10.0) -> int:
    """The Conductor's count of Store blocks once it has not changed for ``quiet_s``: the
    puts of earlier requests (made off the TTFT path) have all been reported, so a later
    ``wait_store_blocks(url, settled + n)`` waits for this test's own ``n`` blocks."""
    def quiet() -> tuple[int] | None:     # a tuple: a settled count of 0 is an answer too
        a = health(url)["num_store_blocks"]
        time.sleep(quiet_s)
        b = health(url)["num_store_blocks"]
        return (b,) if a == b else None
    return wait_for(quiet, timeout_s, "a settled Store block count")[0]


def metric_value(url: str, name: str) -> float:
    """A sample's value from ``url/metrics`` (0.0 when absent), parsed by prometheus-client."""
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for smp in fam.samples:
            if smp.name == name:
                return smp.value
    return 0.0
