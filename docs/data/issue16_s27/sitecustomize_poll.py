import os
if os.environ.get("PMK_POLL") is not None or os.environ.get("PMK_ADAPT") is not None:
    try:
        import pymooncake.rpc.client as _c
        if os.environ.get("PMK_POLL") is not None:
            d = list(_c.SyncRpcClient.__init__.__defaults__)
            d[-1] = float(os.environ["PMK_POLL"])
            _c.SyncRpcClient.__init__.__defaults__ = tuple(d)
        if os.environ.get("PMK_ADAPT") == "0":
            _c.REPLY_POLL_MAX_S = 0.0
    except Exception:
        pass
