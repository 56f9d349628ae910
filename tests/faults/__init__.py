"""Faults injected on namespaced hosts under load (issue 17 Build item 5).

Which test covers which fault (each asserts no hung request, no corrupt byte or token,
and the cluster still serving afterwards):

1. master leader killed (HA) under a P/D replay:
   ``test_pd_faults.py::test_master_leader_killed_under_replay_keeps_serving_and_loses_no_object``
   (store level, no P/D: ``tests/store/test_master_ha.py::test_kill9_leader_under_puts...``)
2. leader frozen (SIGSTOP) past its lease, resumed:
   ``test_pd_faults.py::test_master_leader_frozen_past_its_lease_steps_down_without_split_brain``
   (store level: ``test_master_ha.py::test_frozen_leader_steps_down...``; cut off from etcd:
   ``test_master_ha_partition.py``)
3. storage host killed: ``test_store_faults.py::test_storage_host_killed_...``
   (loopback: ``tests/store/test_store_processes.py::test_bug_33_34_replica_fallback...``)
4. prefill worker killed mid-request: ``test_pd_faults.py::test_prefill_worker_killed_...``
   (decode worker, loopback: ``tests/serving/test_pd_cluster.py::test_decode_worker_killed...``)
5. Conductor partitioned from a decode host: ``test_pd_faults.py::test_decode_host_partitioned_...``
   and ``test_decode_host_cut_during_its_kv_write_...`` (the cut host's requests fail with a
   clean 503 naming it, the others on the same prefill worker are served within 6 s of the
   cut: no 10 s KV write deadline, let alone the Transfer Engine's ~22 s failure bound,
   is waited out; unit level: ``tests/transfer/test_kv_write_cancel.py``,
   ``tests/conductor/test_worker_loss.py``)
6. one of two TCP paths dropped mid-transfer:
   ``test_store_faults.py::test_one_of_two_tcp_paths_...``
   (loopback, a peer that drops its connection: ``tests/transfer/test_failures.py::
   test_path_killed_mid_transfer_slices_retried_on_other_path``)
7. segment filled to the watermark under concurrent puts:
   ``test_store_faults.py::test_segment_filled_under_concurrent_puts_...``
   (single client: ``tests/store/test_store_processes.py::test_eviction_at_watermark...``,
   ``test_no_space_error_without_data_loss``, ``tests/store/test_full_store_processes.py``)

All of them one after another under a trace replay, with a Store checker verifying every
byte: ``pymooncake bench soak`` (``pymooncake.bench.soak``), run short in CI by
``test_soak.py::test_soak_short_run_reports_every_fault_and_loses_no_object``.

Network faults are made with ``ip link set ... down`` and ``ss -K``: the CI kernel has no
``sch_netem`` (``netns.netem_missing`` says so) and the image no iptables. Every test is
skipped, with the reason, only where namespaces or etcd cannot be had (``netns.missing``).
"""
