"""Segment descriptors: a process's registered memory as published in the metadata service.

Key: ``pymooncake/segments/<segment name>``; value: JSON (as Mooncake's
``mooncake/ram/<name>``)::

    {"name": "prefill-0", "host": "127.0.0.1", "host_id": "<boot id>/<hostname>",
     "pid": 1234, "tcp_port": 41000, "transports": ["local", "shm", "tcp"],
     "buffers": [{"addr": 140..., "length": 1048576, "shm_name": "pymooncake-..."}],
     "version": 3, "cma": {"anchor": 140..., "token": "<32 hex digits>"}}

``cma`` is there only when the owner offers the ``cma`` transport (``transports.cma``).

``version`` increases with every (un)registration, so a reader can tell a stale copy.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from functools import cache

SEGMENT_KEY_PREFIX = "pymooncake/segments/"


def segment_key(name: str) -> str:
    return SEGMENT_KEY_PREFIX + name


@cache
def local_host_id() -> str:
    """Identifies this host's kernel (same value ⇔ /dev/shm is shared)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{boot}/{socket.gethostname()}"


@dataclass(frozen=True, slots=True)
class BufferDesc:
    addr: int
    length: int
    shm_name: str | None = None

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length and length >= 0


@dataclass(frozen=True, slots=True)
class SegmentDescriptor:
    name: str
    host: str
    host_id: str
    pid: int
    tcp_port: int
    transports: tuple[str, ...]
    buffers: tuple[BufferDesc, ...]
    version: int = 0
    cma_anchor: int = 0
    """Address of the owner's ``cma`` anchor (0: ``cma`` not offered; ``transports.cma``)."""
    cma_token: str = ""
    """The anchor's 16 random bytes, 32 hex digits."""

    def find(self, addr: int, length: int) -> BufferDesc | None:
        """The registered buffer holding all of ``[addr, addr+length)``, else ``None``."""
        for b in self.buffers:
            if b.contains(addr, length):
                return b
        return None

    def encode(self) -> bytes:
        return json.dumps({
            "name": self.name, "host": self.host, "host_id": self.host_id, "pid": self.pid,
            "tcp_port": self.tcp_port, "transports": list(self.transports),
            "buffers": [{"addr": b.addr, "length": b.length, "shm_name": b.shm_name}
                        for b in self.buffers],
            "version": self.version,
            **({"cma": {"anchor": self.cma_anchor, "token": self.cma_token}}
               if self.cma_anchor else {}),
        }).encode()

    @classmethod
    def decode(cls, data: bytes) -> SegmentDescriptor:
        """Raises ``ValueError`` for a malformed descriptor."""
        try:
            d = json.loads(data)
            return cls(
                name=str(d["name"]), host=str(d["host"]), host_id=str(d["host_id"]),
                pid=int(d["pid"]), tcp_port=int(d["tcp_port"]),
                transports=tuple(d["transports"]),
                buffers=tuple(BufferDesc(int(b["addr"]), int(b["length"]), b.get("shm_name"))
                              for b in d["buffers"]),
                version=int(d.get("version", 0)),
                **_cma_fields(d.get("cma"), d["pid"]))
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed segment descriptor: {e}") from e


def _cma_fields(c: object, pid: object) -> dict[str, object]:
    """The descriptor's ``cma`` entry as fields (none when absent); ``ValueError`` naming
    what is wrong with it or with the ``pid`` it goes with."""
    if c is None:
        return {}
    if type(pid) is not int or not 0 < pid < 1 << 31:
        raise ValueError(f"'pid' must be a process id (int in (0, 2**31)) with 'cma', "
                         f"got {pid!r:.40}")
    if not isinstance(c, dict) or set(c) != {"anchor", "token"}:
        raise ValueError(f"'cma' must be {{'anchor': int, 'token': hex}}, got {c!r:.80}")
    anchor, token = c["anchor"], c["token"]
    if type(anchor) is not int or not 0 < anchor < 1 << 64:
        raise ValueError(f"'cma.anchor' must be an address (int in (0, 2**64)), "
                         f"got {anchor!r:.40}")
    if (not isinstance(token, str) or len(token) != 32
            or any(ch not in "0123456789abcdef" for ch in token)):
        raise ValueError(f"'cma.token' must be 32 lower-case hex digits, got {token!r:.40}")
    return {"cma_anchor": anchor, "cma_token": token}
