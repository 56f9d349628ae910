"""Scheduling policy of the Conductor: pure functions on plain data (DESIGN.md §2, §7).

Mooncake FAST'25 Algorithm 1 and its alternatives, decode placement, admission with early
rejection, hot-block replication. No I/O, no asyncio, no clock reads: the live Conductor and
``pymooncake.sim`` import and call these same function objects.
"""

from pymooncake.conductor.policy.admission import admit_ttft, saturation, schedule
from pymooncake.conductor.policy.cpp import CppCostModel, use_cpp
from pymooncake.conductor.policy.cpp_placement import place_prefill_cpp, with_cpp
from pymooncake.conductor.policy.decode_placement import (
    place_decode,
    predicted_decode_load,
    predicted_tbt_s,
)
from pymooncake.conductor.policy.estimators import (
    DecodeEstimator,
    Estimators,
    PrefillEstimator,
    TransferEstimator,
    fit_decode_estimator,
    fit_prefill_estimator,
)
from pymooncake.conductor.policy.hot_blocks import (
    HotBlockConfig,
    ReuseWindow,
    blocks_to_replicate,
    plan_replication,
)
from pymooncake.conductor.policy.prefill_placement import (
    PREFILL_POLICIES,
    PrefillPolicy,
    evaluate_instance,
    place_prefill_global_cache,
    place_prefill_least_load,
    place_prefill_local_cache,
    place_prefill_random,
    place_prefill_round_robin,
    queue_s,
)
from pymooncake.conductor.policy.prefix_index import (
    PrefixIndex,
    shared_prefix_blocks,
    with_pending,
)
from pymooncake.conductor.policy.types import (
    BlockKeyLike,
    ClusterView,
    DecodeInstanceState,
    InstanceId,
    Placement,
    PolicyConfig,
    PrefillInstanceState,
    PrefixMatch,
    Rejection,
    RequestInfo,
)

__all__ = [
    "PREFILL_POLICIES",
    "BlockKeyLike",
    "ClusterView",
    "CppCostModel",
    "DecodeEstimator",
    "DecodeInstanceState",
    "Estimators",
    "HotBlockConfig",
    "InstanceId",
    "Placement",
    "PolicyConfig",
    "PrefillEstimator",
    "PrefillInstanceState",
    "PrefillPolicy",
    "PrefixIndex",
    "PrefixMatch",
    "Rejection",
    "RequestInfo",
    "ReuseWindow",
    "TransferEstimator",
    "admit_ttft",
    "blocks_to_replicate",
    "evaluate_instance",
    "fit_decode_estimator",
    "fit_prefill_estimator",
    "place_decode",
    "place_prefill_global_cache",
    "place_prefill_cpp",
    "place_prefill_least_load",
    "place_prefill_local_cache",
    "place_prefill_random",
    "place_prefill_round_robin",
    "plan_replication",
    "predicted_decode_load",
    "predicted_tbt_s",
    "queue_s",
    "saturation",
    "schedule",
    "shared_prefix_blocks",
    "use_cpp",
    "with_cpp",
    "with_pending",
]
