from __future__ import annotations

import contextlib

import pytest

from .procs import Cluster


@pytest.fixture
def cluster_factory():
    made: list[Cluster] = []
    clients = []

    def make(*flags: str, **kw) -> Cluster:
        c = Cluster(*flags, **kw)
        made.append(c)
        orig = c.client

        def client(**kw):
            cl = orig(**kw)
            clients.append(cl)
            return cl

        c.client = client  # type: ignore[method-assign]
        return c

    yield make
    for cl in clients:
        with contextlib.suppress(Exception):
            cl.close()
    for c in made:
        c.close()
