"""TransferConfig: the one flat configuration of the Transfer Engine (DESIGN.md §4)."""

from __future__ import annotations

from dataclasses import dataclass

KNOWN_TRANSPORTS = ("local", "shm", "cma", "tcp")
DEFAULT_TRANSPORTS = ("local", "shm", "tcp")
"""``cma`` is opt-in: it needs the right to ``process_vm_writev`` into peers (the same user,
no seccomp filter against it), which containers often withhold."""


@dataclass(frozen=True, slots=True)
class TransferConfig:
    host: str = "127.0.0.1"
    """Address the TCP data server listens on and publishes in the segment descriptor."""
    tcp_port: int = 0
    """TCP data port; 0 picks a free port."""
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    """Transports this engine may use and offers its peers: local (same engine), shm (same
    host, target in shared memory), cma (same host, target in ordinary memory: one kernel
    copy, ``transports/cma.py``; opt-in), tcp (anything else). The choice is fixed:
    local, then shm, then cma, then tcp, whatever the order given."""
    num_paths: int = 2
    """TCP connections per peer; each is a path ("NIC") and slices spread over them."""
    min_slice_bytes: int = 64 * 1024
    """Requests are cut into slices of at least this size (except a shorter tail)."""
    max_slice_bytes: int = 1024 * 1024
    """...and at most this size (Mooncake slices at 64 KiB–1 MiB)."""
    window_bytes: int = 16 * 1024 * 1024
    """Bytes of slices a path sends before it reads their replies (pipelining). With
    16 MiB, a batch of two 16 MiB requests over two paths is one window a path, sent as
    one wire request (a run, ``tcp.runs``); with 8 MiB it moved ~3 % less a second
    (docs/benchmarks.md, issue 16 session 26)."""
    window_slices: int = 64
    """Most slices in flight on one path."""
    slice_timeout_s: float = 5.0
    """Longest one socket operation of a slice may block before the path counts as failed."""
    connect_timeout_s: float = 2.0
    """Longest a TCP connect to a peer may take."""
    max_retries: int = 3
    """Times one slice is re-sent after a path error before its request fails."""
    path_retry_interval_s: float = 0.5
    """A path that failed on a fresh connection is not used again for this long."""
    max_endpoints: int = 256
    """Pooled TCP connections (all peers) before SIEVE evicts one."""
    reply_poll_s: float = 50e-6
    """How long a path polls for the replies of a window it sent (yielding the CPU between
    polls) before it sleeps in the kernel; 0 never polls. A small transfer's reply usually
    comes within it, and a woken sleeper costs far more than that on a VM's CPUs."""
    inline_copy_max_bytes: int = 256 * 1024
    """A ``submit`` whose local/shm/cma copies total at most this many bytes copies them on the
    caller's thread while the copy thread is idle (a few tens of microseconds of memcpy,
    less than waking that thread and handing the GIL back); larger ones go to the copy
    thread and overlap the caller's work. 0: always the copy thread."""
    checksum: bool = False
    """CRC32 per wire request (a slice or a run of slices, ``tcp.runs``), checked on the
    receiving side (tests turn it on)."""
    metadata_timeout_s: float = 5.0
    """Longest a metadata call (publish/resolve a segment) may take."""
    segment_ttl_s: float = 10.0
    """Lease TTL of the published segment descriptor. The engine keeps the lease alive
    every ``segment_ttl_s / 3``; a crashed engine's descriptor (and so its segment name)
    is withdrawn this long after its last keep-alive (etcd rounds up to whole seconds)."""
    topology_file: str | None = None
    """JSON topology overriding discovery from /sys (see transfer.topology)."""

    def __post_init__(self) -> None:
        bad = [t for t in self.transports if t not in KNOWN_TRANSPORTS]
        if bad or not self.transports:
            raise ValueError(f"transports must be a non-empty subset of {KNOWN_TRANSPORTS}, "
                             f"got {self.transports}")
        if not 0 <= self.tcp_port <= 65535:
            raise ValueError(f"tcp_port must be in 0..65535, got {self.tcp_port}")
        if self.num_paths < 1:
            raise ValueError(f"num_paths must be >= 1, got {self.num_paths}")
        if not 0 < self.min_slice_bytes <= self.max_slice_bytes:
            raise ValueError("need 0 < min_slice_bytes <= max_slice_bytes, got "
                             f"{self.min_slice_bytes} and {self.max_slice_bytes}")
        if self.max_slice_bytes > 64 * 1024 * 1024:
            raise ValueError(f"max_slice_bytes must be <= 64 MiB, got {self.max_slice_bytes}")
        if self.window_slices < 1 or not self.max_slice_bytes <= self.window_bytes <= 64 << 20:
            raise ValueError("window_slices must be >= 1 and max_slice_bytes <= window_bytes "
                             f"<= 64 MiB, got {self.window_slices} and {self.window_bytes}")
        for name in ("slice_timeout_s", "connect_timeout_s", "metadata_timeout_s",
                     "segment_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.reply_poll_s <= 0.01:
            raise ValueError(f"reply_poll_s must be in [0, 0.01] seconds, got {self.reply_poll_s}")
        if self.max_retries < 0 or self.path_retry_interval_s < 0:
            raise ValueError("max_retries and path_retry_interval_s must be >= 0")
        if self.inline_copy_max_bytes < 0:
            raise ValueError(f"inline_copy_max_bytes must be >= 0, got "
                             f"{self.inline_copy_max_bytes}")
        if self.max_endpoints < 1:
            raise ValueError(f"max_endpoints must be >= 1, got {self.max_endpoints}")

    @property
    def failure_bound_s(self) -> float:
        """Upper bound on how long a slice to a dead peer stays pending before it fails:
        every try may block one slice timeout (or connect timeout) plus the path back-off."""
        per_try = max(self.slice_timeout_s, self.connect_timeout_s) + self.path_retry_interval_s
        return (self.max_retries + 1) * per_try
