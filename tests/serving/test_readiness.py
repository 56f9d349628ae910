"""Honest readiness, with real processes on loopback: the Conductor's ``/health`` is 503
and says what it waits for until a prefill and a decode worker registered, then 200 — and
the first request after that 200 is served. Also the served model's name on
``/v1/models`` and OpenAI's 404 for another one."""

from __future__ import annotations

import httpx
import pytest

from pymooncake.cli.cluster import ClusterSpec, LocalCluster
from pymooncake.cli.readiness import NotReadyError, wait_ready
from tests.serving.conftest import wait_for

pytestmark = pytest.mark.integration

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def _health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=10)


def test_health_503_until_workers_registered_then_models_lists_the_name_and_404s_another():
    """One cluster for both checks: once it is ready, ``/v1/models`` and the 404."""
    c = LocalCluster(ClusterSpec(quiet=True))
    try:
        m = c._spawn("master", ["master", "--port", "0", "--enable-http-metadata-server",
                                "--http-metadata-server-port", "0"])
        cond = c._spawn("conductor", ["conductor", "--model", "tiny", "--port", "0",
                                      "--worker-port", "0"])
        url = cond["url"]
        # the tokenizer loads in a thread after the socket listens; then only workers lack
        r = wait_for(lambda: (lambda r: r if "tokenizer" not in r.text else None)(_health(url)),
                     10.0, "tokenizer loaded")
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "starting"
        assert body["waiting_for"] == ["a prefill worker to register",
                                       "a decode worker to register"]
        assert body["workers"] == []
        # a request before ready: 503 not_ready with Retry-After, in the OpenAI shape
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "not_ready"
        assert "a prefill worker to register" in r.json()["error"]["message"]
        with pytest.raises(NotReadyError, match="waiting for a prefill worker to register"):
            wait_ready(url, timeout_s=0.3)

        common = ["--model", "tiny", "--conductor", f"127.0.0.1:{cond['worker_port']}",
                  "--metadata", m["metadata_url"], "--num-kv-blocks", "128"]
        c._spawn("prefill-0", ["prefill", "--id", "prefill-0", *common], 60)
        r = _health(url)   # the prefill worker printed "ready" once it was accepted
        assert r.status_code == 503
        assert r.json()["waiting_for"] == ["a decode worker to register"]

        c._spawn("decode-0", ["decode", "--id", "decode-0", *common], 60)
        h = wait_ready(url, timeout_s=30)
        assert h["status"] == "ok" and "waiting_for" not in h
        assert {w["instance_id"] for w in h["workers"]} == {"prefill-0", "decode-0"}
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        assert r.json()["model"] == "tiny"
        _models_lists_the_served_name_and_another_name_is_404(url)
    finally:
        c.stop()


def _models_lists_the_served_name_and_another_name_is_404(url: str) -> None:
    assert _health(url).status_code == 200
    models = httpx.get(url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": "gpt-4"}, timeout=10)
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `gpt-4` does not exist.",
                                  "type": "invalid_request_error", "param": "model",
                                  "code": "model_not_found"}}
    # an absent model field means the served model (documented in api/server.py)
    body = {k: v for k, v in CHAT.items() if k != "model"}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
