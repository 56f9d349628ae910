"""``pymooncake bench soak`` for real, short (issue 17 Build item 7): the command on 3
namespaced hosts, every fault injected once, one after another, and the report's
figures checked — requests served, no hung request, every failure a clean HTTP error,
every fault listed and recovered, the masters' fail-over under 5 s without split brain,
Store bytes verified with no corrupt read and no object lost. The 30-minute run's report
is in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pymooncake.bench.soak_faults import FAULTS

from .netns import missing

pytestmark = pytest.mark.integration


def test_soak_short_run_reports_every_fault_and_loses_no_object(tmp_path):
    why = missing()
    if why:
        pytest.skip(why)
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        # the faults set the length (each waits for the previous one's recovery plus the
        # window): --duration only bounds a run that would end sooner
        [sys.executable, "-m", "pymooncake", "bench", "soak", "--duration", "10",
         "--fault-every", "2", "--window", "2", "--rps", "2", "--max-tokens", "16",
         "--output", str(out), "--json"], capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep == json.loads(proc.stdout)
    print({k: rep[k] for k in ("requests_sent", "requests_served", "errors_by_kind")})
    print([f for f in rep["failures"] if not f["kind"].startswith("HTTP ")])
    assert rep["requests_served"] > 0
    assert rep["requests_served"] + sum(rep["errors_by_kind"].values()) == rep["requests_sent"]
    assert rep["hung_requests"] == 0, rep["failures"]
    # a failure is a clean HTTP answer (a request on a worker that died or was cut off) or,
    # once tokens were streamed, the stream's named error event (a decode worker lost
    # mid-decode: 503 worker_failed as an event, then [DONE]); never an internal error
    assert all(k.startswith("HTTP ") or k == "stream error worker_failed"
               for k in rep["errors_by_kind"]), rep["failures"]
    assert [f["fault"] for f in rep["faults"]] == list(FAULTS)
    for f in rep["faults"]:
        assert f["recovered"], f
        for w in ("before", "during", "after"):
            assert f[w]["sent"] == f[w]["served"] + f[w]["failed"]
    by = {f["fault"]: f for f in rep["faults"]}
    assert by["master_leader_kill"]["failover_s"] < 5.0
    assert by["master_leader_freeze"]["stepped_down"]
    assert not by["master_leader_freeze"]["split_brain"]
    assert by["path_drop"]["connections_dropped"] > 0
    st = rep["store"]
    assert st["objects_put"] > 0 and st["reads_verified"] > 0
    assert st["bytes_verified"] == st["reads_verified"] * 8 * 1024
    assert st["corrupt_reads"] == 0
    # lost: the master no longer knows it (a read's OBJECT_NOT_FOUND may be the client
    # skipping the healed h3 segment it marked bad in the partition: two CI runs counted
    # those as lost, soak/3, 4, 5, 7, ...; the checker now retries them)
    assert st["objects_lost"] == 0, st
    assert st["objects_unchecked"] == 0 and st["objects_unreadable_at_end"] == 0, st
