"""The one control-plane RPC layer: msgpack frames over TCP (over a Unix socket between
processes of one host: ``rpc.local``), typed messages, timeouts.

No pickle on the wire. Every call has a timeout. See ``rpc.codec`` for the frame format,
``rpc.server.RpcServer``, ``rpc.async_client.RpcClient`` and ``rpc.client.SyncRpcClient``
for the ends.
"""

from pymooncake.rpc.async_client import RpcClient
from pymooncake.rpc.client import SyncRpcClient
from pymooncake.rpc.codec import MAX_FRAME_BYTES, Message, decode_as, encode, from_wire, to_wire
from pymooncake.rpc.errors import ErrorCode, RpcConnectionError, RpcError, RpcTimeout
from pymooncake.rpc.server import RpcServer

__all__ = [
    "MAX_FRAME_BYTES",
    "ErrorCode",
    "Message",
    "RpcClient",
    "RpcConnectionError",
    "RpcError",
    "RpcServer",
    "RpcTimeout",
    "SyncRpcClient",
    "decode_as",
    "encode",
    "from_wire",
    "to_wire",
]
