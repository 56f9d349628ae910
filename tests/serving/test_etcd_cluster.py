"""Workers that find each other's segments through a real etcd (``--metadata etcd://…``):
DESIGN.md §4, issue #6 "the same roles started by hand … with ``--metadata etcd://…`` form
one cluster". Same host here (loopback); the KV still moves between separate processes
whose Transfer Engine segments are published in and looked up from etcd."""

from __future__ import annotations

import random

import pytest

from tests.serving.conftest import complete, stream_token_ids, wait_store_blocks

pytest.importorskip("torch")


def test_pd_cluster_over_etcd_moves_kv_and_reuses_through_the_store(etcd_url):
    from pymooncake.cli.cluster import ClusterSpec, LocalCluster
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    cluster = LocalCluster(ClusterSpec(port=0, quiet=True, num_prefill=2, num_decode=1,
                                       policy="round-robin", global_store=True,
                                       max_model_len=1024, num_kv_blocks=256,
                                       metadata=etcd_url))
    try:
        cluster.start()
        assert cluster.metadata_url == etcd_url
        rng = random.Random(7)
        a = [rng.randrange(256) for _ in range(120)]
        ref = Engine.from_model_name("tiny", EngineConfig(max_model_len=1024)).generate(
            [a], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        got, usage, errors = stream_token_ids(cluster.url, a, 6, ignore_eos=True)
        assert not errors and got == list(ref.output_token_ids)   # P→D KV moved intact
        wait_store_blocks(cluster.url, 120 // 16)
        b = a[:96] + [rng.randrange(256) for _ in range(30)]
        r = complete(cluster.url, b, 3)                  # round-robin: the other worker
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    finally:
        cluster.stop()
