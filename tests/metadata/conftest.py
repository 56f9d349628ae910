"""Fixtures: a real HTTP metadata server on a free loopback port (the real etcd is in
tests/conftest.py, shared with the serving tests)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def http_metadata_url() -> Iterator[str]:
    from pymooncake.metadata.http import MetadataHttpServer

    server = MetadataHttpServer("127.0.0.1", 0).start()
    try:
        yield server.url
    finally:
        server.stop()
