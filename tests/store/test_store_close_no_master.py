"""Closing a Store client whose HA masters are all gone is bounded (issue 17; a newcomer saw
a store-server take 5-15 s to stop once every master had died): the unmount is best effort
within ``CLOSE_UNMOUNT_S`` (the masters' client TTL drops the segment otherwise), and a
heartbeat still failing over (10 s) is cancelled by the close instead of waited for."""

from __future__ import annotations

import signal
import time

from pymooncake.bench.failover import ha_master, transfer_config, wait_leader
from pymooncake.store.client import CLOSE_UNMOUNT_S, StoreClient

from .test_master_ha import MiB, _cluster, md_url, procs  # noqa: F401 - fixtures


def test_close_with_every_master_dead_takes_about_the_unmount_bound(
        etcd_url: str, md_url: str, procs: list) -> None:  # noqa: F811
    cluster = _cluster()
    m = ha_master(etcd_url, cluster, 1.0)
    procs.append(m)
    wait_leader([m])
    holder = StoreClient(f"{etcd_url}/{cluster}", md_url, global_segment_size=16 * MiB,
                         transfer_config=transfer_config()).start()
    m.kill(signal.SIGKILL)
    m.popen.wait(10)
    time.sleep(1.5)      # a heartbeat is now failing over, looking for a leader
    t0 = time.monotonic()
    holder.close()
    took = time.monotonic() - t0
    # before: the unmount failed over for 10 s, then close joined the heartbeat thread for
    # up to 5 s more (10.6 s measured); now the unmount's bound and the thread's exit
    assert took < CLOSE_UNMOUNT_S + 1.5, f"close took {took:.2f} s"
