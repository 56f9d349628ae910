"""Early rejection in the live cluster (Mooncake FAST'25 §6, DESIGN.md §7; CASES BUG-51,
BUG-52): an overloaded cluster answers 429 + Retry-After instead of queueing everyone past
the TTFT objective, and a request whose predicted prefill alone exceeds it is refused before
any prefill runs.

The Conductor gets a measured-profile file whose samples follow t = 1 ms per uncached token
exactly, so its predictions are known here: a 400-token prompt is predicted at 0.4 s, a
1500-token one at 1.5 s; the TTFT objective is 1 s.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serving.conftest import complete, health, wait_for, workers


@pytest.fixture(scope="module")
def cluster(make_cluster, tmp_path_factory):
    prof = tmp_path_factory.mktemp("profile") / "profile.json"
    samples = [(n, p, (n - p) * 1e-3) for n, p in ((100, 0), (500, 0), (1000, 0), (1000, 500),
                                                  (2000, 1000))]
    prof.write_text(json.dumps({"samples": [
        {"num_tokens": n, "num_prefix_tokens": p, "seconds": t} for n, p, t in samples]}))
    return make_cluster(num_prefill=1, num_decode=1, ttft_slo_s=1.0, profile=str(prof),
                        max_model_len=2048, num_kv_blocks=512)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _prefill_tokens(url: str) -> int:
    return sum(w["num_prefill_tokens_total"] for w in workers(url).values())


def test_bug_51_rejected_before_any_prefill_when_ttft_slo_unreachable(cluster):
    url = cluster.url
    before = _prefill_tokens(url)
    r = complete(url, _ids(1, 1500), 4)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "ttft_slo"
    assert int(r.headers["Retry-After"]) >= 1
    r2 = complete(url, _ids(2, 100), 4)        # predicted 0.1 s: admitted
    assert r2.status_code == 200, r2.text
    wait_for(lambda: _prefill_tokens(url) == before + 100, 5.0, "the admitted prefill counted")
    # the refused 1500-token prompt never reached a prefill worker
    assert _prefill_tokens(url) == before + 100


def test_overload_answers_429_not_late_for_everyone(cluster):
    url = cluster.url
    prompts = [_ids(10 + i, 400) for i in range(8)]

    def send(p: list[int]) -> httpx.Response:
        return complete(url, p, 4)

    with ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(send, prompts))
    codes = [r.status_code for r in rs]
    assert 200 in codes and 429 in codes, codes
    for r in rs:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "ttft_slo"
            assert int(r.headers["Retry-After"]) >= 1
        else:
            assert r.status_code == 200, r.text
    # at 0.4 s predicted per prompt and a 1 s objective, at most 2 fit in one queue at once
    assert codes.count(200) >= 1
    # drained: the saturation signal is back to 0 and requests are admitted again
    wait_for(lambda: not health(url)["requests"], 10.0, "drained")
    assert health(url)["saturation"] == 0.0
    assert complete(url, _ids(99, 200), 4).status_code == 200
