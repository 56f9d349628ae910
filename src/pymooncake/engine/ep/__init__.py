"""Elastic expert parallelism (docs/ep.md): a MoE model's routed experts sharded over rank
processes, with EPLB-style redundant copies, heartbeat failure detection, re-routing to
surviving copies and re-balancing when a rank rejoins.

* ``placement``: pure placement / routing functions;
* ``rank``: the rank process (``pymooncake ep rank``) that holds and computes experts;
* ``dispatch``: the front's ``ExpertBackend`` that dispatches token rows to the ranks over
  the Transfer Engine and combines the results;
* ``service``: the front service (``pymooncake ep serve``): engine loop + RPC API.
"""
