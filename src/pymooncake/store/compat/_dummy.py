"""The dummy-client side of Mooncake's dummy/real client split: ask the real client
(``python -m pymooncake.compat real-client``) where its master, metadata service and
segment are, over pymooncake's RPC layer."""

from __future__ import annotations

from typing import Any

INFO_METHOD = "real_client_info"


def ask_real_client(server_address: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """``{"master", "metadata", "segment"}`` of the real client at ``host:port``;
    ``OSError`` when it cannot be reached, ``ValueError`` for a bad address or answer."""
    from pymooncake.rpc import RpcError, SyncRpcClient

    host, sep, port = server_address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"server_address={server_address!r}: expected host:port")
    client = SyncRpcClient(host or "127.0.0.1", int(port), timeout_s=timeout_s)
    try:
        info = client.call(INFO_METHOD, {})
    except RpcError as e:
        raise OSError(str(e)) from None
    finally:
        client.close()
    if not isinstance(info, dict) or not all(
            isinstance(info.get(k), str) for k in ("master", "metadata", "segment")):
        raise ValueError(f"unexpected answer from the real client: {info!r}")
    return info
