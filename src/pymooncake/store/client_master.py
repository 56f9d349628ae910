"""The Store client's control plane: master RPCs (one connection per calling thread),
metadata-only operations (exist, remove, leases, listing) and the two-phase primitives for
callers that write the bytes themselves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pymooncake.rpc import RpcError, SyncRpcClient, to_wire
from pymooncake.store.client_base import DEFAULT_CONFIG, MAX_KEY_BYTES, ClientBase
from pymooncake.store.config import ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.leader import LeaderSyncRpc
from pymooncake.store.master.core_state import keys_fast_ok, validate_key
from pymooncake.store.protocol import (
    BatchExistRequest,
    ExistRequest,
    KeyRequest,
    KeysRequest,
    PutEndRequest,
    PutHandle,
    PutStartRequest,
    ReadAnswer,
    RemoveAllRequest,
    RemoveRequest,
    ReplicaList,
)

_BOOL_ONLY = {bool}


class MasterOps(ClientBase):
    """Master RPC and metadata-only methods of ``StoreClient``."""

    # -- master RPC --------------------------------------------------------------------

    @property
    def _rpc(self) -> SyncRpcClient:
        """This thread's connection to the master (threads do not queue behind each other)."""
        rpc = getattr(self._rpc_local, "rpc", None)
        if rpc is None:
            rpc = LeaderSyncRpc(self.master_locator, self._rpc_timeout)
            self._rpc_local.rpc = rpc
            with self._lock:
                self._rpcs.append(rpc)
        return rpc

    def _master(self, method: str, params: Any, reply_type: Any = None) -> Any:
        """The master's answer to ``method`` (decoded as ``reply_type`` when given, every
        field checked), or its ``StoreError``."""
        if self._dp is None:  # never started, or closed: refused before the master
            self._started_dp(method)
        try:
            return self._rpc.call(method, params, reply_type=reply_type)
        except RpcError as e:
            raise StoreError.from_rpc(e) from None

    @staticmethod
    def _batch_item(item: Any) -> Any:
        """One key's answer of a batch call: a map (``{"r": result}`` or ``{"e": [code,
        message]}``), a typed answer (``ReadAnswer``, ``WriteAnswer``) or, from
        ``batch_exist``, a bare bool."""
        if type(item) is bool:
            return item
        if type(item) is dict:
            if "e" in item:
                code, msg = item["e"]
                return StoreError(ErrorCode(code), msg)
            return item.get("r")
        if item.e is not None:
            return StoreError(ErrorCode(item.e[0]), item.e[1])
        return item.r


    @staticmethod
    def _check_key(key: object) -> str:
        """The key, or ``StoreError(INVALID_KEY)`` (generic ``INVALID_ARGUMENT``) for a
        non-str, empty, over-long (> ``MAX_KEY_BYTES`` UTF-8 bytes), NUL-carrying or not
        UTF-8-encodable key (case BUG-28): refused here, before any RPC, never a crash."""
        if type(key) is str and key.isascii() and 0 < len(key) <= MAX_KEY_BYTES \
                and "\x00" not in key:
            return key  # ASCII: one byte a character, encodable; the checks below all pass
        validate_key(key, MAX_KEY_BYTES)
        assert isinstance(key, str)
        if "\x00" in key:
            raise StoreError(ErrorCode.INVALID_KEY, "key contains a NUL character")
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise StoreError(ErrorCode.INVALID_KEY, "key is not valid UTF-8 "
                             "(lone surrogate)") from None
        return key

    @staticmethod
    def _keys_ok(keys: Sequence[object]) -> bool:
        """True when ``_check_key`` passes every key at its fast path (str, ASCII, 1 to
        ``MAX_KEY_BYTES`` characters, no NUL; ``keys_fast_ok``); False means "check them
        one by one", not that one is bad."""
        return keys_fast_ok(keys, MAX_KEY_BYTES, no_nul=True)

    # -- metadata-only -----------------------------------------------------------------

    def _bad_now(self) -> list[str]:
        """Segments this client currently knows to have failed (see ``bad_segment_ttl_s``)."""
        if not self._bad:
            return []
        now = self._clock()
        return [seg for seg, until in list(self._bad.items()) if until > now]

    def exist(self, key: str) -> bool:
        """True for a published object with a replica this client may read: a key whose
        every replica lies on a segment this client knows to have failed is reported
        absent, as ``get`` answers ``OBJECT_NOT_FOUND`` for it (case BUG-34)."""
        self._check_key(key)
        return bool(self._master("exist", ExistRequest(self.client_id, key,
                                                       tuple(self._bad_now()))))

    def get_size(self, key: str) -> int:
        """The size in bytes of ``key``'s object (held in DRAM or on SSD): one master call,
        no read lease (no bytes are read, as ``exist``). ``StoreError``: ``INVALID_KEY``,
        ``OBJECT_NOT_FOUND`` (also when every replica lies on a segment this client knows
        to have failed), ``REPLICA_IS_NOT_READY`` while it is written."""
        self._check_key(key)
        return int(self._master("get_size", ExistRequest(self.client_id, key,
                                                         tuple(self._bad_now()))))

    def batch_exist(self, keys: Sequence[str]) -> list[bool | StoreError]:
        """``exist`` per key (same rule for keys on failed segments)."""
        if self._keys_ok(keys):  # the usual case: every key good, one call for all
            res = self._master("batch_exist", BatchExistRequest(
                self.client_id, tuple(keys), tuple(self._bad_now()) if self._bad else ()))
            if len(res) != len(keys):
                raise StoreError(ErrorCode.INTERNAL_ERROR, f"batch_exist: {len(res)} answers for "
                                 f"{len(keys)} keys")
            if {*map(type, res)} == _BOOL_ONLY:
                return res  # every answer a bool (the usual case): no per-key step
            item = self._batch_item
            return [x if type(x) is bool else item(x) for x in res]
        out: list[bool | StoreError] = []
        ask: list[int] = []
        for i, k in enumerate(keys):
            try:
                self._check_key(k)
                ask.append(i)
                out.append(False)
            except StoreError as e:  # a bad key is its own answer, the rest still asked
                out.append(e)
        if not ask:
            return out
        res = self._master("batch_exist", BatchExistRequest(
            self.client_id, tuple(keys[i] for i in ask), tuple(self._bad_now())))
        for i, x in zip(ask, res, strict=True):
            out[i] = self._batch_item(x)
        return out

    def remove(self, key: str, force: bool = False) -> None:
        self._check_key(key)
        self._locations.pop(key, None)
        self._master("remove", RemoveRequest(self.client_id, key, force))

    def remove_all(self, force: bool = False) -> int:
        self._locations.clear()
        return int(self._master("remove_all", RemoveAllRequest(self.client_id, force)))

    def release_leases(self, keys: Sequence[str]) -> int:
        return int(self._master("release_leases", KeysRequest(self.client_id, tuple(keys))))

    def list_keys(self) -> list[str]:
        return list(self._master("list_keys", None))

    def stats(self) -> dict[str, Any]:
        return dict(self._master("stats", None))

    def ping(self) -> bool:
        try:
            return self._rpc.call("ping", None, timeout_s=2.0) == "pong"
        except RpcError:
            return False
    # -- two-phase primitives (for callers that write the bytes themselves) -------------

    def replica_list(self, key: str) -> ReplicaList:
        """The master's answer for ``key`` (grants a read lease)."""
        self._check_key(key)
        r = self._master("get_replica_list", KeyRequest(self.client_id, key), ReplicaList)
        if r.promote:
            (item,) = self._master("load_replica_list", KeysRequest(self.client_id, (key,)),
                                   list[ReadAnswer])
            r = self._batch_item(item)
            if isinstance(r, StoreError):
                raise r
        return r

    def put_start(self, key: str, size_bytes: int,
                  config: ReplicateConfig | None = None) -> PutHandle:
        self._check_key(key)
        return self._master("put_start", PutStartRequest(
            self.client_id, key, size_bytes, to_wire(config or DEFAULT_CONFIG)), PutHandle)

    def put_end(self, key: str, generation: int, checksum: bytes | None = None) -> None:
        """Publish a write started by ``put_start``. ``checksum``: the written bytes'
        ``store.checksum.digests``; without one the object is published but never
        verifies on read (``CHECKSUM_MISMATCH``: unverifiable bytes are not data)."""
        self._master("put_end", PutEndRequest(self.client_id, key, generation, checksum))

    def put_revoke(self, key: str, generation: int) -> None:
        self._master("put_revoke", PutEndRequest(self.client_id, key, generation))
