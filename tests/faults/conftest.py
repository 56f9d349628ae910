"""Fixtures for the fault tests: namespaced hosts (skipped, with the reason, only where
namespaces or etcd cannot be had) and a request replay that checks every answer."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .netns import Hosts, missing

CONTEXT = 2048


@pytest.fixture
def hosts() -> Iterator[Any]:
    """``hosts(n)`` builds n namespaced hosts; all of them are torn down after the test."""
    why = missing()
    if why:
        pytest.skip(why)
    made: list[Hosts] = []

    def make(n: int) -> Hosts:
        h = Hosts(n)
        made.append(h)
        return h.start()

    try:
        yield make
    finally:
        for h in made:
            h.close()


def prompts(seed: int, groups: int = 2, per: int = 3, shared: int = 160, tail: int = 9
            ) -> list[list[int]]:
    """``groups`` x ``per`` prompts; those of a group share a ``shared``-token prefix."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        head = [rng.randrange(256) for _ in range(shared)]
        out += [head + [rng.randrange(256) for _ in range(tail)] for _ in range(per)]
    return out


def reference(ps: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy output of one colocated engine: what every served request must equal."""
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    eng = Engine.from_model_name("tiny", EngineConfig(max_model_len=CONTEXT))
    return [list(r.output_token_ids) for r in
            eng.generate(ps, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]


def one_request(url: str, prompt: list[int], max_tokens: int, timeout_s: float
                ) -> dict[str, Any]:
    """Stream one completion; never raises: the outcome is in the returned record."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    out: dict[str, Any] = {"status": None, "ids": [], "errors": [], "exc": None,
                           "done": False, "t0": time.monotonic()}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body,
                          timeout=timeout_s) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["body"] = r.read().decode(errors="replace")[:300]
            else:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            out["errors"].append(chunk["error"])
                        for ch in chunk.get("choices", []):
                            out["ids"].extend(ch.get("token_ids") or [])
    except Exception as e:  # noqa: BLE001 - a transport failure is a finding, kept
        out["exc"] = repr(e)
    out["t1"] = time.monotonic()
    return out


class Replay:
    """``threads`` clients sending the prompts round-robin until ``stop()``; ``check()``
    asserts the fault tests' invariants on every request that was sent."""

    def __init__(self, url: str, ps: list[list[int]], refs: list[list[int]], *,
                 threads: int = 2, max_tokens: int = 8, bound_s: float = 25.0) -> None:
        self.url, self.ps, self.refs = url, ps, refs
        self.max_tokens, self.bound_s = max_tokens, bound_s
        self.results: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                         for k in range(threads)]

    def _run(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            n = i % len(self.ps)
            rec = one_request(self.url, self.ps[n], self.max_tokens, self.bound_s + 5)
            rec["prompt"] = n
            with self._lock:
                self.results.append(rec)
            i += len(self._threads)

    def start(self) -> Replay:
        for t in self._threads:
            t.start()
        return self

    def served_after(self, t: float) -> int:
        with self._lock:
            return sum(1 for r in self.results if r["t0"] > t and ok(r))

    def wait_served(self, n: int, after: float = 0.0, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.served_after(after) < n:
            assert time.monotonic() < deadline, \
                f"fewer than {n} requests served in {timeout_s} s: {self.summary()}"
            time.sleep(0.05)

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        for t in self._threads:
            t.join(self.bound_s + 10)
            assert not t.is_alive(), "a replay request hung past its bound"
        return self.results

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._lock:
            for r in self.results:
                kind = "ok" if ok(r) else ("clean" if clean_error(r) else "bad")
                out[kind] = out.get(kind, 0) + 1
        return out

    def check(self) -> None:
        """No hung request (each ended within the bound), no corrupt token (every served
        request equals the colocated engine's greedy output), every failure a clean one."""
        print("replay:", self.summary())
        for r in self.results:
            assert r["t1"] - r["t0"] < self.bound_s, ("request took too long", r)
            if ok(r):
                assert r["ids"] == self.refs[r["prompt"]], ("wrong output", r)
            else:
                assert clean_error(r), ("not a clean error", r)


def ok(r: dict[str, Any]) -> bool:
    return r["status"] == 200 and r["done"] and not r["errors"] and r["exc"] is None


def clean_error(r: dict[str, Any]) -> bool:
    """An HTTP error status, or an error event that ends the stream: never a dropped
    connection, a timeout or a stream cut without its end."""
    if r["exc"] is not None:
        return False
    if r["status"] != 200:
        return r["status"] is not None and r["status"] >= 400
    return bool(r["errors"]) and r["done"]
