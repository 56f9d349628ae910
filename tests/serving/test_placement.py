"""Algorithm 1 in the live cluster (Mooncake FAST'25 §4): KV events from the prefill workers
feed the Conductor's prefix index, and a request sharing a prefix goes to the prefill
worker that holds it (no transfer, least predicted TTFT)."""

from __future__ import annotations

import random
import time

import pytest

from tests.serving.conftest import complete, health, wait_for, workers


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(num_prefill=2, num_decode=1, policy="global-cache",
                        max_model_len=2048, num_kv_blocks=512)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _counts(url: str) -> dict[str, int]:
    def stable() -> dict[str, int] | None:
        a = {k: w["num_prefill_tokens_total"] for k, w in workers(url).items()
             if w["role"] == "prefill"}
        time.sleep(0.3)
        b = {k: w["num_prefill_tokens_total"] for k, w in workers(url).items()
             if w["role"] == "prefill"}
        return b if a == b else None
    return wait_for(stable, 10.0, "stable load reports")


def test_algorithm_1_sends_a_shared_prefix_to_the_worker_holding_it(cluster):
    url = cluster.url
    before = _counts(url)
    a = _ids(1, 320)                                   # 20 full blocks
    assert complete(url, a, 2).status_code == 200
    mid = wait_for(lambda: (lambda c: c if sum(c.values()) == sum(before.values()) + 320
                            else None)(_counts(url)), 10.0, "A's prefill counted")
    holder = next(k for k in mid if mid[k] != before[k])
    # the holder's 20 blocks reached the Conductor's index as KV events
    wait_for(lambda: health(url)["num_indexed_blocks"] >= 20, 10.0, "KV events indexed")
    b = a + _ids(2, 40)
    r = complete(url, b, 2)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 320
    after = wait_for(lambda: (lambda c: c if sum(c.values()) == sum(mid.values()) + 40
                              else None)(_counts(url)), 10.0, "B's prefill counted")
    assert after[holder] == mid[holder] + 40, "B was not placed on the prefix holder"
