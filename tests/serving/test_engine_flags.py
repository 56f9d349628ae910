"""``--threads`` and ``--decode-step-tokens`` of the workers and ``serve``: a colocated
worker given two threads and a decode-step cap serves exactly what one engine computes,
and bad values exit 2 naming the flag."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serving.conftest import health, stream_token_ids, wait_for, workers


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_two_thread_colocated_worker_with_a_decode_cap_equals_one_engine(make_cluster):
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    cluster = make_cluster(colocated=True, num_prefill=1, num_decode=0, num_threads=2,
                           decode_step_tokens=32, max_model_len=2048, num_kv_blocks=512,
                           max_num_batched_tokens=256)
    (w,) = workers(cluster.url).values()
    assert w["role"] == "colocated"
    # long prompts arriving while others decode: their chunks are cut to the cap
    prompts = [_ids(70 + i, 300 + 97 * i) for i in range(4)]
    ref = Engine.from_model_name("tiny", EngineConfig(max_model_len=2048)).generate(
        prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: stream_token_ids(cluster.url, p, 10, ignore_eos=True),
                            prompts))
    for (ids, usage, errors), r in zip(got, ref, strict=True):
        assert not errors
        assert ids == list(r.output_token_ids)
        assert usage["completion_tokens"] == 10


def test_colocated_worker_profiles_at_start_and_teaches_the_conductor_online(make_cluster):
    """With ``--startup-profile-tokens`` the Conductor's prefill estimator is fitted when
    the worker registers (before any request); without it, it keeps the config's defaults
    until 16 colocated requests have finished, whose ``prefill`` windows it then fits."""
    from pymooncake.conductor.config import ConductorConfig
    on = make_cluster(colocated=True, num_prefill=1, num_decode=0, max_model_len=2048,
                      startup_profile_tokens=1024)
    est = health(on.url)["prefill_estimator"]
    assert est["num_online_fits"] == 1
    # every term >= 0 and the time grows with the prompt (the tiny model's millisecond
    # prefills are noisy on a loaded machine: which term carries the growth varies)
    assert min(est["quadratic_s"], est["linear_s"], est["overhead_s"]) >= 0
    assert est["quadratic_s"] * 1024 ** 2 + est["linear_s"] * 1024 > 0
    defaults = ConductorConfig()
    off = make_cluster(colocated=True, num_prefill=1, num_decode=0, max_model_len=2048,
                       startup_profile_tokens=0)
    est = health(off.url)["prefill_estimator"]
    assert est == {"quadratic_s": defaults.prefill_quadratic_s,
                   "linear_s": defaults.prefill_linear_s,
                   "overhead_s": defaults.prefill_overhead_s, "num_online_fits": 0}
    for i in range(16):
        ids, _, errors = stream_token_ids(off.url, _ids(200 + i, 40 + 60 * i), 2)
        assert not errors and len(ids) == 2
    wait_for(lambda: health(off.url)["prefill_estimator"]["num_online_fits"] == 1,
             what="an online fit from the colocated requests")


PREFILL = ["prefill", "--id", "p", "--conductor", "127.0.0.1:1"]
DECODE = ["decode", "--id", "d", "--conductor", "127.0.0.1:1"]
COLOCATED = ["decode", "--colocated", "--id", "c", "--conductor", "127.0.0.1:1"]


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["serve", "--decode-step-tokens", "0"], "--decode-step-tokens must be >= 1, got 0"),
    ([*COLOCATED, "--threads", "-2"], "--threads must be >= 1, got -2"),
    ([*COLOCATED, "--decode-step-tokens", "0"], "--decode-step-tokens must be >= 1, got 0"),
    (["serve", "--decode-step-s", "0"], "--decode-step-s must be in (0, 3600) seconds, got 0.0"),
    ([*COLOCATED, "--decode-step-s", "nan"], "--decode-step-s must be in (0, 3600) seconds"),
    (["serve", "--prefill-hold-s", "-1"], "--prefill-hold-s must be in (0, 3600) seconds"),
    ([*COLOCATED, "--prefill-hold-s", "inf"], "--prefill-hold-s must be in (0, 3600) seconds"),
    ([*PREFILL, "--aging-tokens-per-s", "-1"], "--aging-tokens-per-s must be in [0, 1e9)"),
    (["serve", "--decode-step-interval-s", "-1"],
     "--decode-step-interval-s must be in [0, 10] seconds"),
    (["serve", "--decode-step-interval-s", "1.5"],
     "--decode-step-interval-s (1.5 s) must be below --tbt-slo (1.0 s)"),
    (["bench", "serving", "--configs", "colocated-cache", "--decode-step-interval-s", "0.05"],
     "--decode-step-interval-s paces the P/D configs' decode workers; --configs "
     "colocated-cache has none"),
    (["serve", "--colocated", "--decode-step-interval-s", "0.05"],
     "--decode-step-interval-s paces decode workers; it does not apply with --colocated"),
    ([*DECODE, "--decode-step-interval-s", "nan"],
     "--decode-step-interval-s must be in [0, 10] seconds"),
    ([*COLOCATED, "--decode-step-interval-s", "0.05"],
     "--decode-step-interval-s applies to decode workers only, not to a colocated worker"),
    (["bench", "serving", "--decode-step-interval-s", "11"],
     "--decode-step-interval-s must be in [0, 10] seconds, got 11.0"),
    (["serve", "--startup-profile-tokens", "-1"], "--startup-profile-tokens must be >= 0"),
    ([*COLOCATED, "--startup-profile-tokens", "-5"], "--startup-profile-tokens must be >= 0"),
    (["serve", "--prefill-order", "lifo"], "--prefill-order: invalid choice: 'lifo'"),
    # the engine's sizes on the worker roles: one line, not an EngineConfig traceback
    # (a newcomer got 38-41 lines and exit 1, a ZeroDivisionError for --block-size 0)
    ([*PREFILL, "--max-num-batched-tokens", "-5"],
     "--max-num-batched-tokens must be >= 1, got -5"),
    ([*PREFILL, "--block-size", "0"], "--block-size must be >= 1, got 0"),
    ([*PREFILL, "--num-kv-blocks", "0"], "--num-kv-blocks must be >= 1, got 0"),
    ([*PREFILL, "--prefill-batch", "0"], "--prefill-batch must be >= 1, got 0"),
    ([*DECODE, "--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    ([*DECODE, "--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
])
def test_bad_engine_flags_exit_2_naming_the_flag(argv, message, capsys):
    from pymooncake.cli.main import main
    try:
        rc = main([*argv, "--model", "tiny"])
    except SystemExit as e:
        rc = e.code
    stderr = capsys.readouterr().err
    assert rc == 2, stderr
    assert message in stderr
