"""Engine worker processes: the I/O shells around ``Engine`` (DESIGN.md §1, §6).

``prefill.PrefillWorker`` (prefill role + Store client + KV sender), ``decode.DecodeWorker``
(decode or colocated role + KV receiver). ``base.EngineWorker`` holds what they share:
the engine thread, the RPC server, registration and load reports to the Conductor.
"""
