"""Namespaced hosts for the fault tests: ``pymooncake.bench.netns`` (shared with the soak
benchmark, ``pymooncake bench soak``); a role that exits or is not ready raises
``RuntimeError`` naming it."""

from pymooncake.bench.netns import Hosts, Role, etcd_binary, missing, netem_missing

__all__ = ["Hosts", "Role", "etcd_binary", "missing", "netem_missing"]
