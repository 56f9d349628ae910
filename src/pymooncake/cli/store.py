"""``pymooncake`` sub-commands of the store: ``master`` and ``store-server``
(``bench store`` is in ``cli.bench_store``).

Master flags carry Mooncake's ``mooncake_master`` names in CLI form (units as Mooncake:
lease and soft-pin TTLs in ms, client TTL in s). Both servers print one JSON line
``{"event": "ready", ...}`` on stdout once they serve, then run until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import signal
import sys
import threading

from pymooncake.cli.common import unusable_dir
from pymooncake.cli.store_flags import flag_message
from pymooncake.store.config import ALLOCATION_STRATEGIES, DEFAULT_RPC_POLL_S, MasterConfig


def parse_size(text: str) -> int:
    """Bytes, with an optional K/M/G/KB/MB/GB/KiB/MiB/GiB suffix (powers of 1024)."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must be >= 0, got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``master`` and ``store-server``."""
    m = subparsers.add_parser("master", help="run a Mooncake Store master",
                              description="Run a Mooncake Store master (object metadata, "
                              "allocation, leases, eviction).")
    m.add_argument("--host", default="127.0.0.1",
                   help="address the RPC server binds (default 127.0.0.1)")
    m.add_argument("--port", type=int, default=50051, help="RPC port (0 = any free port)")
    m.add_argument("--default-kv-lease-ttl", type=float, default=10_000.0, metavar="MS",
                   help="read lease granted by a get, not by exist (ms, default 10000)")
    m.add_argument("--default-kv-soft-pin-ttl", type=float, default=1_800_000.0, metavar="MS",
                   help="soft-pin lifetime from publish (ms, default 30 min)")
    m.add_argument("--eviction-high-watermark-ratio", type=float, default=0.90,
                   help="evict when used / capacity of the DRAM pool exceeds this "
                   "(in (0, 1], default 0.90)")
    m.add_argument("--eviction-ratio", type=float, default=0.05,
                   help="share of the evictable objects one eviction pass removes, at "
                   "least enough to get under the watermark (in [0, 1], default 0.05)")
    m.add_argument("--client-ttl", type=float, default=10.0, metavar="S",
                   help="drop a client silent this long (s, default 10)")
    m.add_argument("--allocation-strategy", default="random",
                   choices=ALLOCATION_STRATEGIES,
                   help="which segment a replica goes to first (default random)")
    m.add_argument("--put-start-discard-timeout", type=float, default=30.0, metavar="S",
                   help="an unfinished put may be taken over by another put of its key "
                   "after this (s, default 30)")
    m.add_argument("--put-start-release-timeout", type=float, default=600.0, metavar="S",
                   help="a taken-over put's space is freed this long after its start "
                   "(s, default 600)")
    m.add_argument("--rereplicate-budget", type=int, default=256 << 20, metavar="BYTES",
                   help="bytes one re-replication pass copies at most, restoring the "
                   "replicas a failure took (default 256 MiB, a pass every 0.5 s)")
    m.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port")
    m.add_argument("--rpc-poll", type=float, default=DEFAULT_RPC_POLL_S, metavar="S",
                   help="while requests come at most S apart, poll S after each before "
                   f"sleeping (s in [0, 0.01], default {DEFAULT_RPC_POLL_S:g}; 0 = never)")
    m.add_argument("--enable-http-metadata-server", action="store_true",
                   help="also serve a Mooncake-style HTTP metadata server (as Mooncake's)")
    m.add_argument("--http-metadata-server-port", type=int, default=8080,
                   help="port of that metadata server (default 8080; 0 = any free port)")
    m.add_argument("--metadata", default=None, metavar="URL",
                   help="Transfer Engine metadata service the master's replica copies use "
                        "(hot-block replication; default: the embedded HTTP metadata server "
                        "when enabled, else no copies)")
    m.add_argument("--ha", "--enable-ha", dest="ha", action="store_true",
                   help="high availability: elect a leader among the masters of "
                   "--cluster-id through --etcd-endpoints; followers refuse calls with the "
                   "leader's address, and the leader journals its metadata there")
    m.add_argument("--etcd-endpoints", default=None, metavar="URL",
                   help="etcd for --ha: etcd://host:port (or host:port)")
    m.add_argument("--cluster-id", default="default",
                   help="masters with the same id form one HA set (default: default)")
    m.add_argument("--ha-lease-ttl", type=float, default=2.0, metavar="S",
                   help="the leader's etcd lease (whole s >= 1, default 2): a dead leader "
                   "is replaced about this long after it stops")
    m.add_argument("--ha-snapshot-every", type=int, default=1000, metavar="N",
                   help="journal entries between snapshots of the leader's metadata (>= 1, "
                   "default 1000); the journal is trimmed up to each snapshot")
    m.set_defaults(handler=_run_master)

    s = subparsers.add_parser("store-server", help="contribute DRAM (and SSD) to a store",
                              description="Run a process that only contributes a DRAM "
                              "segment (and optionally an SSD tier) to a Mooncake Store.")
    s.add_argument("--master", required=True, metavar="HOST:PORT",
                   help="the master: host:port, or an HA set (host:port,host:port or "
                   "etcd://host:port[/cluster_id]) whose leader is followed")
    s.add_argument("--metadata", required=True, metavar="URL",
                   help="metadata service: http://h:p/metadata, etcd://h:p")
    s.add_argument("--global-segment-size", type=parse_size, default=1 << 30, metavar="BYTES")
    s.add_argument("--local-hostname", default="127.0.0.1")
    s.add_argument("--ssd-path", default=None, metavar="DIR")
    s.add_argument("--ssd-capacity", type=parse_size, default=0, metavar="BYTES")
    s.add_argument("--no-ssd-recover", dest="ssd_recover", action="store_false",
                   help="start with an empty SSD tier (delete the files of a previous run) "
                   "instead of verifying them and registering the intact ones again")
    s.add_argument("--transports", default="local,shm,tcp",
                   help="Transfer Engine transports, comma-separated")
    s.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="S",
                   help="master heartbeat period (s > 0, default 1)")
    s.add_argument("--startup-timeout", type=float, default=5.0, metavar="S",
                   help="longest wait for each answer of the metadata service and the master "
                   "while joining (s, default 5); then exit 1 with one line")
    s.set_defaults(handler=_run_store_server)


def _ready(payload: dict) -> None:
    sys.stdout.write(json.dumps({"event": "ready", **payload}) + "\n")
    sys.stdout.flush()


def _stop_event() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _run_master(args: argparse.Namespace) -> int:
    import asyncio

    from pymooncake.cli.main import UsageError
    from pymooncake.store.master.service import MasterService

    try:
        cfg = MasterConfig(
            host=args.host, port=args.port,
            default_kv_lease_ttl_ms=args.default_kv_lease_ttl,
            default_kv_soft_pin_ttl_ms=args.default_kv_soft_pin_ttl,
            eviction_high_watermark_ratio=args.eviction_high_watermark_ratio,
            eviction_ratio=args.eviction_ratio, client_ttl_s=args.client_ttl,
            allocation_strategy=args.allocation_strategy,
            put_start_discard_timeout_s=args.put_start_discard_timeout,
            put_start_release_timeout_s=args.put_start_release_timeout,
            metrics_port=args.metrics_port,
            rereplicate_budget_bytes=args.rereplicate_budget, rpc_poll_s=args.rpc_poll)
    except ValueError as e:
        raise UsageError(flag_message(str(e))) from None
    ha = _ha_config(args)
    if args.metadata:   # the replica copies' metadata service: refuse one that is down now
        from pymooncake.cli.role_common import check_metadata_url, check_reachable
        check_metadata_url("--metadata", args.metadata)
        check_reachable("master", "--metadata", args.metadata)

    async def main() -> None:
        from pymooncake.obs import metrics

        md = None
        svc = MasterService(cfg, ha=ha)
        try:
            # every listening socket is bound before "ready"; a busy port is one line
            with _binding("--port", cfg.port, cfg.host), _etcd_reachable(args):
                await svc.start()
            if args.enable_http_metadata_server:
                from pymooncake.metadata.http import MetadataHttpServer

                with _binding("--http-metadata-server-port", args.http_metadata_server_port,
                              args.host):
                    md = MetadataHttpServer(args.host, args.http_metadata_server_port).start()
            svc.copier.metadata_url = args.metadata or (md.url if md is not None else None)
            svc.copier.prepare()
            if cfg.metrics_port is not None:
                with _binding("--metrics-port", cfg.metrics_port, cfg.host):
                    metrics.serve_metrics(cfg.metrics_port, cfg.host)
        except BaseException:
            await svc.stop()
            if md is not None:
                md.stop()
            raise
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        from pymooncake.cli.role_common import stop_on_signals
        stop_on_signals(loop, stop.set)
        _ready({"port": svc.port, "host": cfg.host,
                "metadata_url": md.url if md is not None else None,
                **({"ha": True, "cluster_id": ha.cluster_id} if ha is not None else {})})
        try:
            await stop.wait()
        finally:
            await svc.stop()
            if md is not None:
                md.stop()

    _run_loop(main())
    return 0


def _ha_config(args: argparse.Namespace):  # noqa: ANN202
    """The ``HaConfig`` of ``--ha`` (``None`` without it); ``UsageError`` (exit 2) for a
    missing or malformed ``--etcd-endpoints`` or a bad ``--ha-lease-ttl``."""
    from pymooncake.cli.main import UsageError
    from pymooncake.store.master.ha import HaConfig

    if not args.ha:
        if args.etcd_endpoints:
            raise UsageError("--etcd-endpoints given without --ha: add --ha (or drop it)")
        return None
    url = args.etcd_endpoints
    if not url:
        raise UsageError("--ha needs --etcd-endpoints etcd://host:port")
    if "://" not in url:
        url = "etcd://" + url
    if not url.startswith("etcd://"):
        raise UsageError(f"--etcd-endpoints {args.etcd_endpoints!r}: expected etcd://host:port")
    try:
        from pymooncake.metadata.etcd import EtcdMetadata

        EtcdMetadata(url)
        return HaConfig(url, cluster_id=args.cluster_id, lease_ttl_s=args.ha_lease_ttl,
                        snapshot_every=args.ha_snapshot_every)
    except ValueError as e:
        raise UsageError(f"--ha: {flag_message(str(e))}") from None


@contextlib.contextmanager
def _etcd_reachable(args: argparse.Namespace):
    """etcd of ``--ha`` unreachable at start: one line, exit 1."""
    from pymooncake.cli.main import CommandError
    from pymooncake.metadata import MetadataError

    try:
        yield
    except MetadataError as e:
        raise CommandError(f"--etcd-endpoints {args.etcd_endpoints}: etcd unreachable "
                           f"({e})") from None


@contextlib.contextmanager
def _binding(flag: str, port: int, host: str):
    """Turn a failure to listen on ``host:port`` into a one-line ``CommandError`` that
    names the flag (exit 1), instead of a traceback."""
    from pymooncake.cli.main import CommandError
    from pymooncake.rpc.local import UnixNameTaken

    try:
        yield
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE and not isinstance(e, UnixNameTaken):
            why = "address already in use"  # a taken Unix name keeps the server's words
        raise CommandError(f"{flag} {port}: cannot listen on {host}:{port}: {why}") from None


def _run_loop(coro) -> None:
    """uvloop when installed (a faster event loop for the master's many small RPCs)."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        asyncio.run(coro)
    else:
        uvloop.run(coro)


def _run_store_server(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError
    from pymooncake.cli.role_common import check_metadata_url
    from pymooncake.store.client import StoreClient
    from pymooncake.store.errors import StoreError
    from pymooncake.store.leader import MasterLocator
    from pymooncake.transfer import TransferConfig

    # flags checked before anything connects: each error names the flag (exit 2)
    check_metadata_url("--metadata", args.metadata)
    if args.global_segment_size <= 0:
        raise UsageError(f"--global-segment-size {args.global_segment_size}: a store-server "
                         "contributes memory; give a size > 0 (e.g. 1G)")
    if args.ssd_capacity > 0 and not args.ssd_path:
        raise UsageError("--ssd-capacity given without --ssd-path: add --ssd-path DIR or "
                         "drop --ssd-capacity")
    if args.ssd_path and args.ssd_capacity <= 0:
        raise UsageError("--ssd-path given without --ssd-capacity: add --ssd-capacity "
                         "BYTES > 0 (e.g. 10G)")
    if args.ssd_path:
        why = unusable_dir(args.ssd_path)
        if why:
            raise UsageError(f"--ssd-path {args.ssd_path}: {why}")
    if not args.heartbeat_interval > 0 or args.heartbeat_interval != args.heartbeat_interval:
        raise UsageError(f"--heartbeat-interval {args.heartbeat_interval}: must be > 0 "
                         "seconds (default 1)")
    if not args.startup_timeout > 0:
        raise UsageError(f"--startup-timeout {args.startup_timeout}: must be > 0 seconds")
    try:
        MasterLocator(args.master)
    except ValueError as e:
        raise UsageError(f"--master: {e}") from None
    try:
        tcfg = TransferConfig(host=args.local_hostname,
                              transports=tuple(args.transports.split(",")),
                              metadata_timeout_s=args.startup_timeout)
        client = StoreClient(args.master, args.metadata, local_hostname=args.local_hostname,
                             global_segment_size=args.global_segment_size,
                             local_buffer_size=0, ssd_path=args.ssd_path,
                             ssd_capacity=args.ssd_capacity, transfer_config=tcfg,
                             heartbeat_interval_s=args.heartbeat_interval,
                             rpc_timeout_s=args.startup_timeout,
                             ssd_recover=args.ssd_recover)
    except ValueError as e:
        raise UsageError(str(e)) from None
    stop = _stop_event()
    try:
        client.start()
    except StoreError as e:
        raise CommandError(f"cannot join the store (--master {args.master}, --metadata "
                           f"{args.metadata}): {e}") from None
    except OSError as e:    # the SSD tier's directory, checked above, failed on use
        if not args.ssd_path:
            raise
        with contextlib.suppress(Exception):
            client.close()
        raise CommandError(f"--ssd-path {args.ssd_path}: {e.strerror or e}"
                           f"{f' ({e.filename})' if e.filename else ''}") from None
    extra = {}
    if client.ssd is not None:
        rec = client.recovery or {}
        extra = {"ssd_dir": str(client.ssd.path), "holder": client.holder,
                 "ssd_recovery": {**rec, "skipped": [list(x) for x in rec.get("skipped", [])]}}
    _ready({"segment": client.segment_name, "size_bytes": args.global_segment_size, **extra})
    try:
        stop.wait()
    finally:
        client.close()
    return 0
