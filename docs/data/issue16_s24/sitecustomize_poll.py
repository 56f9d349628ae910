import os
if os.environ.get("PMK_POLL") is not None:
    try:
        import pymooncake.rpc.client as _c
        d = list(_c.SyncRpcClient.__init__.__defaults__)
        d[-1] = float(os.environ["PMK_POLL"])
        _c.SyncRpcClient.__init__.__defaults__ = tuple(d)
    except Exception:
        pass
