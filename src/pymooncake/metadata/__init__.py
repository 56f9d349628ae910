"""pymooncake.metadata: key-value metadata with TTL leases and watches (DESIGN.md §2).

Backends, chosen by URL with :func:`open_metadata`:

* ``embedded://[name]`` (default): in-process, shared by handles of the same name;
* ``http://host:port/metadata``: Mooncake-style HTTP metadata server
  (``pymooncake metadata-server``, :class:`~pymooncake.metadata.http.MetadataHttpServer`);
* ``etcd://host:port``: a real etcd v3 server.

:class:`~pymooncake.metadata.election.LeaderElection` elects a leader over any backend.
"""

from __future__ import annotations

from pymooncake.metadata.base import (
    EventKind,
    KeyValue,
    LeaseId,
    LeaseNotFound,
    MetadataError,
    MetadataStore,
    Watch,
    WatchCompacted,
    WatchEvent,
)

__all__ = [
    "EventKind", "KeyValue", "LeaseId", "LeaseNotFound", "MetadataError", "MetadataStore",
    "Watch", "WatchCompacted", "WatchEvent", "open_metadata",
]


def open_metadata(url: str = "embedded://") -> MetadataStore:
    """A :class:`MetadataStore` for ``url``.

    Accepts ``embedded://`` / ``embedded://name``, ``http://host:port/metadata`` (Mooncake's
    form) and ``etcd://host:port``. Raises ``TypeError`` when ``url`` is not a ``str``
    and ``ValueError`` for any other scheme or a malformed URL (the message names it).
    """
    if not isinstance(url, str):
        raise TypeError(f"metadata url must be a str (embedded://[name], "
                        f"http://host:port/metadata or etcd://host:port), got "
                        f"{type(url).__name__} {url!r}")
    if url.startswith("embedded://"):
        from pymooncake.metadata.embedded import EmbeddedMetadata

        return EmbeddedMetadata(url[len("embedded://"):] or "default")
    if url.startswith("http://"):
        from pymooncake.metadata.http_client import HttpMetadata

        return HttpMetadata(url)
    if url.startswith("etcd://"):
        from pymooncake.metadata.etcd import EtcdMetadata

        return EtcdMetadata(url)
    raise ValueError(f"unsupported metadata url {url!r}: use embedded://[name], "
                     "http://host:port/metadata or etcd://host:port")
