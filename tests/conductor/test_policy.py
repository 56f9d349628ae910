"""conductor.policy on small crafted cluster views; expected placements derived by hand."""

from __future__ import annotations

import pytest

from pymooncake.conductor.policy import (
    PREFILL_POLICIES,
    ClusterView,
    DecodeEstimator,
    DecodeInstanceState,
    Estimators,
    HotBlockConfig,
    InstanceId,
    Placement,
    PolicyConfig,
    PrefillEstimator,
    PrefillInstanceState,
    PrefixIndex,
    PrefixMatch,
    Rejection,
    RequestInfo,
    TransferEstimator,
    blocks_to_replicate,
    evaluate_instance,
    place_decode,
    predicted_tbt_s,
    schedule,
)
from pymooncake.conductor.policy.prefill_placement import mix64

# prefill: 1 ms/token; transfer: 1000 B/token at 1e7 B/s = 0.1 ms/token; decode step:
# 0.01 + max(0, 0.02 + 1e-7·ctx).
EST = Estimators(PrefillEstimator(0.0, 1e-3, 0.0), TransferEstimator(1000, 1e7, 0.0),
                 DecodeEstimator(0.01, 0.02, 1e-7, 0.0))
REQ = RequestInfo("r", 2048, (1, 2, 3, 4), 10, 0.0, sequence_number=4)
IDS = (InstanceId("p0"), InstanceId("p1"), InstanceId("p2"))


def _view(decode: tuple[DecodeInstanceState, ...] = ()) -> ClusterView:
    return ClusterView(0.0, (PrefillInstanceState(IDS[0], 0.0, 0.0),
                             PrefillInstanceState(IDS[1], 0.3, 0.2),   # queue 0.5 s
                             PrefillInstanceState(IDS[2], 0.0, 0.2)),  # queue 0.2 s
                       decode)


def _index() -> PrefixIndex:
    idx = PrefixIndex()
    idx.insert(IDS[1], [1, 2, 3])
    idx.insert(IDS[2], [1, 9])
    return idx


class TestPrefixIndex:
    def test_match_per_instance_and_best(self) -> None:
        m = _index().match(REQ.block_keys, IDS)
        assert m == PrefixMatch((0, 3, 1), 3, IDS[1])

    def test_local_only_has_no_best_holder(self) -> None:
        assert _index().match(REQ.block_keys, IDS, remote=False) == PrefixMatch((0, 3, 1))

    def test_gap_stops_the_prefix_and_evict_removes(self) -> None:
        idx = PrefixIndex()
        idx.insert(IDS[0], [1, 3, 4])          # key 2 missing: only 1 block matches
        assert idx.match((1, 2, 3, 4), IDS).local_blocks == (1, 0, 0)
        idx.evict(IDS[0], [1])
        assert idx.match((1, 2, 3, 4), IDS) == PrefixMatch((0, 0, 0))
        assert len(idx) == 2 and idx.num_replicas(3) == 1


class TestPrefillPolicies:
    match = _index().match(REQ.block_keys, IDS)
    cfg = PolicyConfig()

    def test_local_cache_aware_picks_least_ttft_without_transfer(self) -> None:
        # p0: 0 + 2.048; p1: 0.5 + 0.512 = 1.012; p2: 0.2 + 1.536 = 1.736  -> p1
        p = PREFILL_POLICIES["local-cache"](REQ, _view(), self.match, EST, self.cfg)
        assert isinstance(p, Placement)
        assert (p.prefill_instance, p.prefix_blocks, p.transfer_blocks) == ("p1", 3, 0)
        assert p.predicted_ttft_s == pytest.approx(1.012)

    def test_global_cache_aware_fetches_from_best_holder(self) -> None:
        # p0: 1536 tok·0.1 ms = 0.1536 + 0.512 = 0.6656; p1: 1.012; p2: 0.2 + 0.1024 + 0.512
        p = PREFILL_POLICIES["global-cache"](REQ, _view(), self.match, EST, self.cfg)
        assert isinstance(p, Placement)
        assert (p.prefill_instance, p.prefix_blocks, p.transfer_blocks,
                p.transfer_source) == ("p0", 3, 3, "p1")
        assert p.predicted_transfer_s == pytest.approx(0.1536)
        assert p.predicted_ttft_s == pytest.approx(0.6656)

    def test_balancing_threshold_blocks_small_gains(self) -> None:
        # p2 holds 1 block, best holds 3: ratio 3 > 1 fetches 2 blocks; ratio 3 <= 4 does not.
        p = evaluate_instance(REQ, _view(), self.match, 2, EST, self.cfg, remote=True)
        assert (p.transfer_blocks, p.predicted_ttft_s) == (2, pytest.approx(0.8144))
        p = evaluate_instance(REQ, _view(), self.match, 2, EST,
                              PolicyConfig(kvcache_balancing_threshold=4.0), remote=True)
        assert (p.transfer_blocks, p.predicted_ttft_s) == (0, pytest.approx(1.736))

    def test_least_load_picks_smallest_queue(self) -> None:
        p = PREFILL_POLICIES["load"](REQ, _view(), PrefixMatch((0, 3, 1)), EST, self.cfg)
        assert isinstance(p, Placement) and p.prefill_instance == "p0"
        assert p.predicted_ttft_s == pytest.approx(2.048)

    def test_round_robin_uses_sequence_number(self) -> None:
        p = PREFILL_POLICIES["round-robin"](REQ, _view(), self.match, EST, self.cfg)
        assert isinstance(p, Placement) and p.prefill_instance == "p1"   # 4 mod 3

    def test_random_is_splitmix64_of_seed_and_sequence(self) -> None:
        def splitmix64(x: int) -> int:  # reference: Steele et al. / Vigna, one output of state x
            m = (1 << 64) - 1
            x = (x + 0x9E3779B97F4A7C15) & m
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
            return x ^ (x >> 31)
        assert mix64(7, 11) == splitmix64((7 * 0x9E3779B97F4A7C15 + 11) & ((1 << 64) - 1))
        picks = [PREFILL_POLICIES["random"](
            RequestInfo("r", 100, (), 1, 0.0, sequence_number=s), _view(), PrefixMatch((0, 0, 0)),
            EST, PolicyConfig(seed=3)).prefill_instance for s in range(3000)]
        assert {n: picks.count(n) for n in ("p0", "p1", "p2")} == {
            n: sum(mix64(3, s) % 3 == i for s in range(3000)) for i, n in enumerate(IDS)}
        assert min(picks.count(n) for n in IDS) > 900

    def test_no_instance(self) -> None:
        for f in PREFILL_POLICIES.values():
            out = f(REQ, ClusterView(0.0, (), ()), PrefixMatch(()), EST, self.cfg)
            assert isinstance(out, Rejection) and out.reason == "no_instance"


class TestDecodePlacement:
    def test_judged_at_prefill_end_not_now(self) -> None:
        # d0 runs 10 now but all finish at 0.5 s, before the prefill ends (0.6656 s):
        # predicted batch 1. d1 runs 5 that finish at 100 s: predicted batch 6.
        d0 = DecodeInstanceState(InstanceId("d0"), 10, 10_000, 10**6, 64, (0.5,) * 10)
        d1 = DecodeInstanceState(InstanceId("d1"), 5, 5_000, 10**6, 64, (100.0,) * 5)
        out = schedule(REQ, _view((d1, d0)), _index().match(REQ.block_keys, IDS), EST,
                       PolicyConfig())
        assert isinstance(out, Placement) and out.decode_instance == "d0"
        # TBT is judged conservatively over the whole decode: batch 10 + 1 = 11 stays,
        # context 10,000 + 2,048 + 11 · 10 output tokens = 12,158:
        # step = 0.01 + 0.02 + 1e-7 · 12,158 = 0.0312158; k = 9 intervals → the longest
        # ceil(9/10) = 1, the first interval (up to 2 steps) → 2 · step.
        assert out.predicted_tbt_s == pytest.approx(2 * 0.0312158)

    def test_kv_capacity_excludes_an_instance(self) -> None:
        d0 = DecodeInstanceState(InstanceId("d0"), 0, 0, 2000, 64)        # 2048 + 10 > 2000
        d1 = DecodeInstanceState(InstanceId("d1"), 3, 3000, 10**6, 64, (50.0,) * 3)
        p = PREFILL_POLICIES["local-cache"](REQ, _view(), PrefixMatch((0, 0, 0)), EST,
                                            PolicyConfig())
        out = place_decode(REQ, _view((d0, d1)), p, EST, PolicyConfig())
        assert isinstance(out, Placement) and out.decode_instance == "d1"

    def test_tbt_slo_rejects_only_with_early_rejection(self) -> None:
        d0 = DecodeInstanceState(InstanceId("d0"), 4, 1_000_000, 10**7, 64, (50.0,) * 4)
        # step: 0.01 + 0.02 + 1e-7 · (1_000_000 + 2048 + 5 · 10) = 0.1302098 s; TBT 2 steps
        p = PREFILL_POLICIES["load"](REQ, _view(), PrefixMatch((0, 0, 0)), EST, PolicyConfig())
        out = place_decode(REQ, _view((d0,)), p, EST, PolicyConfig(early_rejection=True))
        assert isinstance(out, Rejection) and out.reason == "tbt_slo"
        assert out.predicted_tbt_s == pytest.approx(2 * 0.1302098)
        out = place_decode(REQ, _view((d0,)), p, EST, PolicyConfig(early_rejection=False))
        assert isinstance(out, Placement) and out.decode_instance == "d0"

    def test_no_batch_slot_or_kv_room_is_decode_full_not_tbt(self) -> None:
        """A decode pool without a free batch slot / KV room is ``decode_full`` even when its
        TBT would be fine (newcomer check: it was labelled ``tbt_slo``)."""
        full = DecodeInstanceState(InstanceId("d0"), 64, 64, 10**7, 64, (50.0,) * 64)
        small = DecodeInstanceState(InstanceId("d1"), 0, 0, 2000, 64)      # 2048 + 10 > 2000
        p = PREFILL_POLICIES["load"](REQ, _view(), PrefixMatch((0, 0, 0)), EST, PolicyConfig())
        out = place_decode(REQ, _view((full, small)), p, EST, PolicyConfig(tbt_slo_s=100.0))
        assert isinstance(out, Rejection) and out.reason == "decode_full"


    def test_predicted_tbt_counts_growth_and_the_first_interval(self) -> None:
        d = DecodeInstanceState(InstanceId("d0"), 3, 30_000, 10**7, 64, (0.1,) * 3,
                                num_incoming=1, incoming_context_tokens=5_000)
        # 101 output tokens -> k = 100 intervals, top ceil(100/10) = 10, one of them the
        # first interval (2 steps): tbt = step · 11/10. Batch 3 + 1 + 1 = 5 (the three that
        # finish at 0.1 s count: under load they are replaced); context 30,000 + 5,000 +
        # 2,048 + 5 · 101 = 37,553 -> step 0.01 + 0.02 + 1e-7 · 37,553 = 0.0337553.
        req = RequestInfo("r", 2048, (), 101, 0.0)
        assert predicted_tbt_s(d, req, EST) == pytest.approx(0.0337553 * 1.1)
        # one output token: no intervals, no TBT to predict (never a tbt_slo rejection).
        assert predicted_tbt_s(d, RequestInfo("r", 2048, (), 1, 0.0), EST) == 0.0


class TestHotBlocks:
    def test_min_accesses_and_replica_cap(self) -> None:
        acc = {1: 5, 2: 1, 3: 3}.__getitem__
        reps = {1: 2, 2: 1, 3: 4}.__getitem__
        assert blocks_to_replicate((1, 2, 3), acc, reps, HotBlockConfig()) == (1, 2, 3)
        assert blocks_to_replicate((1, 2, 3), acc, reps, HotBlockConfig(min_accesses=3)) == (1, 3)
        assert blocks_to_replicate((1, 2, 3), acc, reps,
                                   HotBlockConfig(min_accesses=3, max_replicas=4)) == (1,)

    def test_bad_config(self) -> None:
        with pytest.raises(ValueError, match="min_accesses"):
            HotBlockConfig(min_accesses=0)
        with pytest.raises(ValueError, match="ttft_slo_s"):
            PolicyConfig(ttft_slo_s=0)
        with pytest.raises(ValueError, match="num_prompt_tokens"):
            RequestInfo("r", 0, (), 1, 0.0)


class TestEstimatorFit:
    def test_recovers_exact_coefficients(self) -> None:
        from pymooncake.conductor.policy import fit_prefill_estimator
        true = PrefillEstimator(3e-10, 2e-4, 0.05)
        samples = [(n, p, true.prefill_s(n, p)) for n, p in
                   ((1000, 0), (4000, 1000), (8000, 0), (16000, 8000), (32000, 0))]
        est = fit_prefill_estimator(samples, with_overhead=True)
        assert est.quadratic_s == pytest.approx(3e-10, rel=1e-6)
        assert est.linear_s == pytest.approx(2e-4, rel=1e-6)
        assert est.overhead_s == pytest.approx(0.05, rel=1e-6)

    def test_figure14a_points_give_the_papers_relative_fit(self) -> None:
        # PAPER.md §6: a relative least-squares fit of the five no-cache points of Figure 14a
        # gives 7.196e-10·n² + 1.146e-4·n.
        from pymooncake.conductor.policy import fit_prefill_estimator
        pts = {8192: 1.002, 16384: 2.055, 32768: 4.478, 65536: 10.587, 131072: 27.514}
        est = fit_prefill_estimator([(n, 0, t) for n, t in pts.items()])
        assert est.quadratic_s == pytest.approx(7.196e-10, rel=0.002)
        assert est.linear_s == pytest.approx(1.146e-4, rel=0.002)
        for n, t in pts.items():      # and lands within 2.5 % of every point
            assert est.prefill_s(n) == pytest.approx(t, rel=0.025)
        with pytest.raises(ValueError, match="at least 2"):
            fit_prefill_estimator([(10, 0, 1.0)])


def test_queue_time_on_a_shortest_first_instance_counts_only_shorter_jobs() -> None:
    """A shortest-first prefill instance: a job waits for the running prefill and the queued
    jobs no longer than itself (hand arithmetic)."""
    from pymooncake.conductor.policy import InstanceId, PrefillInstanceState, queue_s
    inst = PrefillInstanceState(InstanceId("p0"), busy_until_s=10.5, queued_prefill_s=1.6,
                                num_in_flight=4, queued_prefills_s=(0.1, 0.5, 1.0),
                                shortest_first=True)
    assert queue_s(inst, 10.0, 0.05) == pytest.approx(0.5)
    assert queue_s(inst, 10.0, 0.5) == pytest.approx(0.5 + 0.1 + 0.5)
    assert queue_s(inst, 10.0, 3.0) == pytest.approx(0.5 + 1.6)
    fcfs = PrefillInstanceState(InstanceId("p1"), 10.5, 1.6, 4, None, (0.1, 0.5, 1.0), False)
    assert queue_s(fcfs, 10.0, 0.05) == pytest.approx(2.1)


def test_online_prefill_profile_recovers_the_measured_cost() -> None:
    """The Conductor refits T_prefill from the compute windows workers report: samples made
    with t = 2e-8·(n²−p²) + 1e-4·(n−p) + 3e-3 give those coefficients back."""
    from pymooncake.conductor.config import ConductorConfig
    from pymooncake.conductor.service import Conductor
    c = Conductor(ConductorConfig(online_profile_every=8))
    before = c.estimators.prefill
    for i, (n, p) in enumerate([(100, 0), (400, 0), (900, 160), (1600, 0), (2500, 800),
                                (300, 32), (1200, 0), (50, 0)]):
        t = 2e-8 * (n * n - p * p) + 1e-4 * (n - p) + 3e-3
        assert c.num_profile_fits == 0 and c.estimators.prefill == before
        c.learn_prefill(n, p, (("queue", 0.0, 1.0), ("prefill", 5.0 + i, 5.0 + i + t)))
    assert c.num_profile_fits == 1
    est = c.estimators.prefill
    assert est.quadratic_s == pytest.approx(2e-8, rel=1e-6)
    assert est.linear_s == pytest.approx(1e-4, rel=1e-6)
    assert est.overhead_s == pytest.approx(3e-3, rel=1e-6)
    c.learn_prefill(100, 100, (("prefill", 0.0, 1.0),))      # nothing computed: not a sample
    c.learn_prefill(100, 0, (("queue", 0.0, 1.0),))          # no compute window: ignored
    assert len(c._profile) == 8


def test_least_ttft_counts_the_delay_a_short_job_imposes_on_a_shortest_first_queue() -> None:
    """Two idle-ish shortest-first instances (hand arithmetic, EST: 1 ms/token, no prefix).
    p0 runs a job until t=0.1 and queues a 2.0 s one; p1 runs one until t=0.15. A 40-token
    request (0.04 s) finishes first on p0 (0.14 s vs 0.19 s) and there starts before the
    2.0 s job, delaying it by 0.04 s: cost 0.18 s on p0 vs 0.19 s on p1 -> p0. At 60 tokens:
    p0 0.16 + 0.06 = 0.22 s, p1 0.21 s -> p1, although its own TTFT is 0.05 s longer there.
    FIFO instances keep Algorithm 1's own-TTFT choice (p0)."""
    from pymooncake.conductor.policy.prefill_placement import delay_imposed_s
    sjf = (PrefillInstanceState(IDS[0], 0.1, 2.0, 2, None, (2.0,), True),
           PrefillInstanceState(IDS[1], 0.15, 0.0, 1, None, (), True))
    fifo = tuple(PrefillInstanceState(i.instance_id, i.busy_until_s, 0.0, i.num_in_flight)
                 for i in sjf)
    assert delay_imposed_s(sjf[0], 0.06) == pytest.approx(0.06)
    assert delay_imposed_s(sjf[0], 2.5) == 0.0 and delay_imposed_s(fifo[0], 0.06) == 0.0
    none = PrefixMatch((0, 0))
    for n, want in ((40, "p0"), (60, "p1")):
        req = RequestInfo("r", n, (), 10, 0.0)
        for name in ("global-cache", "local-cache"):
            p = PREFILL_POLICIES[name](req, ClusterView(0.0, sjf, ()), none, EST,
                                       PolicyConfig())
            assert isinstance(p, Placement) and p.prefill_instance == want, (n, name)
        if want == "p1":      # the reported prediction is still the request's own TTFT
            assert p.predicted_ttft_s == pytest.approx(0.21)
        p = PREFILL_POLICIES["global-cache"](req, ClusterView(0.0, fifo, ()), none, EST,
                                             PolicyConfig())
        assert isinstance(p, Placement) and p.prefill_instance == "p0"


def test_a_workers_startup_profile_fits_the_prefill_estimator_at_registration() -> None:
    """Samples of t = 3e-8·n² + 2e-4·n + 5e-3 (hand-made) give those coefficients back at
    once; with an explicit estimator (``--profile``) they only join the online profile."""
    from pymooncake.conductor.config import ConductorConfig
    from pymooncake.conductor.policy import PrefillEstimator
    from pymooncake.conductor.service import Conductor
    samples = [(n, 0, 3e-8 * n * n + 2e-4 * n + 5e-3) for n in (128, 256, 512, 1024, 2048)]
    c = Conductor(ConductorConfig())
    c.learn_profile(samples)
    est = c.estimators.prefill
    assert c.num_profile_fits == 1
    assert est.quadratic_s == pytest.approx(3e-8, rel=1e-6)
    assert est.linear_s == pytest.approx(2e-4, rel=1e-6)
    assert est.overhead_s == pytest.approx(5e-3, rel=1e-6)
    mine = PrefillEstimator(1e-9, 1e-5, 0.0)
    c2 = Conductor(ConductorConfig(), prefill_estimator=mine)
    c2.learn_profile(samples)
    assert c2.estimators.prefill == mine and c2.num_profile_fits == 0
    assert list(c2._profile) == samples
    c3 = Conductor(ConductorConfig(online_profile=False))
    c3.learn_profile(samples)
    assert c3.num_profile_fits == 0 and not c3._profile


@pytest.mark.parametrize(("raw", "message"), [
    ("{", "not JSON"),
    ('{"a": 1}', "must be a list"),
    ("[[100, 0]]", "sample 0 is not"),
    ("[[100, 0, 0.5], [0, 0, 0.1]]", "sample 1 is not"),
    ("[[100, 100, 0.5]]", "sample 0 is not"),
    ("[[100, 0, -1]]", "sample 0 is not"),
    ("[[100, 0, NaN]]", "sample 0 is not"),
    ("[[100.5, 0, 1.0]]", "sample 0 is not"),
    ("[[true, 0, 1.0]]", "sample 0 is not"),
    ("[" + ",".join(["[10, 0, 0.1]"] * 257) + "]", "at most 256"),
])
def test_a_malformed_startup_profile_is_refused_naming_what_is_wrong(raw, message) -> None:
    from pymooncake.conductor.request_stages import profile_samples
    with pytest.raises(ValueError, match=message):
        profile_samples(raw)
    assert profile_samples("") == []
    assert profile_samples("[[100, 20, 0.5], [200, 0, 1]]") == [(100, 20, 0.5), (200, 0, 1.0)]


def test_a_prefix_still_being_computed_counts_as_held() -> None:
    from pymooncake.conductor.policy import PrefixMatch, shared_prefix_blocks, with_pending
    keys = ["k1", "k2", "k3", "k4"]
    # the longest leading run any in-flight prompt shares: 2 (k1 k2 x) and 3 (k1 k2 k3 k9)
    assert shared_prefix_blocks(keys, [("k1", "k2", "x"), ("k1", "k2", "k3", "k9")]) == 3
    assert shared_prefix_blocks(keys, [("k2", "k1")]) == 0        # order matters
    assert shared_prefix_blocks(keys, [("k1", "k2", "k3", "k4", "k5")]) == 4
    assert shared_prefix_blocks(keys, []) == 0
    m = PrefixMatch(local_blocks=(1, 0, 4), best_blocks=4, best_holder="p2")
    got = with_pending(m, (3, 0, 2))
    assert got == PrefixMatch(local_blocks=(3, 0, 4), best_blocks=4, best_holder="p2")
    assert with_pending(m, (0, 0, 0)) is m
    with pytest.raises(ValueError, match="pending has 2 entries for 3 instances"):
        with_pending(m, (1, 2))
