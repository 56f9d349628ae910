"""pymooncake.store: the Mooncake Store (DESIGN.md §5, Mooncake paper §3.2).

Public API:

* ``pymooncake.store.client.StoreClient`` — put/get/get_into/batch_*/exist/remove over the
  master RPC and the Transfer Engine; ``pymooncake.store.config.ReplicateConfig``;
* ``pymooncake.store.errors.ErrorCode`` / ``StoreError`` (Mooncake's numbers);
* ``pymooncake.store.compat.MooncakeDistributedStore`` — Mooncake's Python class;
* ``pymooncake.store.master.service.MasterService`` / ``MasterConfig`` — the master
  (``pymooncake master``); ``pymooncake store-server`` contributes DRAM/SSD.

See docs/store.md.
"""
