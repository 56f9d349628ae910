"""Topology: NUMA nodes and network devices from /sys → preferred/secondary device matrix.

Follows Mooncake's topology matrix (Transfer Engine docs): for each memory location
(``cpu:<numa node>``) a list of *preferred* devices (on the same NUMA node) and
*secondary* devices (the others). A JSON file in the same shape overrides discovery::

    {"cpu:0": [["eth0"], ["eth1"]], "cpu:1": [["eth1"], ["eth0"]]}

Discovery skips virtual network devices (no ``device`` link under ``/sys/class/net/<dev>``:
``lo``, ``ifb*``, ``veth*``, bridges, tunnels); they are listed as ``virtual`` instead. A
physical device whose NUMA node is unknown (``numa_node`` missing or ``-1``, as on most VMs)
is preferred for every node, since no node is nearer to it.

Path selection: the tcp path ``k`` to a peer uses device ``preferred[k % len(preferred)]``
for memory on NUMA node ``n`` (or the secondary list when there is no preferred device):
its connection is bound to that device's IPv4 address, so it leaves through that NIC.
To a loopback peer every path uses ``lo``.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True, slots=True)
class Topology:
    """``matrix[location] = (preferred devices, secondary devices)``."""

    matrix: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
    source: str
    """``sysfs`` or the override file's path."""
    virtual: tuple[str, ...] = ()
    """Virtual devices seen by discovery and left out of the matrix (``lo``, ``ifb0``…)."""

    def devices_for(self, location: str) -> tuple[str, ...]:
        """Devices to use for memory at ``location``, best first (``("lo",)`` if none)."""
        entry = self.matrix.get(location) or next(iter(self.matrix.values()), None)
        if entry is None:
            return ("lo",)
        preferred, secondary = entry
        return preferred or secondary or ("lo",)

    def path_device(self, location: str, path_index: int) -> str:
        devices = self.devices_for(location)
        return devices[path_index % len(devices)]

    def to_json(self) -> dict[str, object]:
        return {"source": self.source,
                "matrix": {loc: [list(p), list(s)] for loc, (p, s) in self.matrix.items()},
                "virtual": list(self.virtual)}


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            cpus.extend(range(int(a), int(b) + 1))
        else:
            cpus.append(int(part))
    return cpus


def discover(sys_root: str | os.PathLike[str] = "/sys") -> Topology:
    """Read NUMA nodes and network devices from ``sys_root`` (a fake tree in tests)."""
    root = Path(sys_root)
    nodes = sorted(int(p.name[4:]) for p in (root / "devices/system/node").glob("node[0-9]*"))
    if not nodes:
        nodes = [0]
    devices: dict[str, int] = {}
    virtual: list[str] = []
    net = root / "class/net"
    for dev in sorted(net.iterdir()) if net.is_dir() else []:
        if not (dev / "device").exists():  # lo, ifb, veth, bridges: no hardware behind
            virtual.append(dev.name)
            continue
        numa = -1
        f = dev / "device/numa_node"
        if f.exists():
            try:
                numa = int(f.read_text().strip())
            except ValueError:
                numa = -1
        devices[dev.name] = numa
    names = sorted(devices)
    matrix: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for n in nodes:
        # A device on an unknown node (-1) is no farther from node n than from any other.
        preferred = tuple(d for d in names if devices[d] in (n, -1))
        secondary = tuple(d for d in names if devices[d] not in (n, -1))
        matrix[f"cpu:{n}"] = (preferred, secondary)
    return Topology(matrix, "sysfs", tuple(virtual))


def load(path: str | os.PathLike[str]) -> Topology:
    """Read a topology JSON file; ``ValueError`` names what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read topology file {path}: {e}") from e
    if not isinstance(data, dict) or not data:
        raise ValueError(f"topology file {path} must be an object like "
                         '{"cpu:0": [["eth0"], ["eth1"]]}')
    matrix: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for loc, entry in data.items():
        if (not isinstance(entry, list) or len(entry) != 2
                or not all(isinstance(x, list) for x in entry)):
            raise ValueError(f"topology file {path}: entry {loc!r} must be "
                             "[[preferred devices], [secondary devices]]")
        matrix[str(loc)] = (tuple(map(str, entry[0])), tuple(map(str, entry[1])))
    return Topology(matrix, str(path))


def get_topology(topology_file: str | None = None) -> Topology:
    """The override file when given, else discovery from /sys."""
    return load(topology_file) if topology_file else discover()


@cache
def device_ipv4(device: str) -> str | None:
    """The IPv4 address of network device ``device`` (``None`` when it has none)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", device.encode()[:15]))
    except OSError:
        return None
    return socket.inet_ntoa(packed[20:24])
