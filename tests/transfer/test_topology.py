"""Topology discovery from a /sys tree and the JSON override."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pymooncake.transfer.topology import device_ipv4, discover, get_topology, load


def make_sys(root: Path) -> Path:
    for n in (0, 1):
        (root / f"devices/system/node/node{n}").mkdir(parents=True)
    for dev, numa in (("eth0", 0), ("eth1", 1), ("eth2", 1)):
        d = root / f"class/net/{dev}/device"
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{numa}\n")
    (root / "class/net/lo").mkdir(parents=True)  # virtual: no device/ directory
    (root / "class/net/ifb0").mkdir(parents=True)  # virtual too
    return root


def test_discover_builds_preferred_and_secondary_per_numa_node(tmp_path: Path) -> None:
    topo = discover(make_sys(tmp_path))
    assert topo.matrix == {
        "cpu:0": (("eth0",), ("eth1", "eth2")),
        "cpu:1": (("eth1", "eth2"), ("eth0",)),
    }
    assert topo.virtual == ("ifb0", "lo")
    # Paths of memory on node 1 alternate over its two local NICs.
    assert [topo.path_device("cpu:1", k) for k in range(3)] == ["eth1", "eth2", "eth1"]


def test_json_file_overrides_discovery(tmp_path: Path) -> None:
    f = tmp_path / "topo.json"
    f.write_text(json.dumps({"cpu:0": [["mlx5_1"], ["mlx5_0"]]}))
    topo = get_topology(str(f))
    assert topo.source == str(f)
    assert topo.devices_for("cpu:0") == ("mlx5_1",)
    f.write_text(json.dumps({"cpu:0": ["mlx5_1"]}))
    with pytest.raises(ValueError, match="preferred devices"):
        load(f)


def test_cli_topology_json(tmp_path: Path) -> None:
    f = tmp_path / "topo.json"
    f.write_text(json.dumps({"cpu:0": [["eth9"], []]}))
    out = subprocess.run([sys.executable, "-m", "pymooncake", "transfer", "topology", "--json",
                          "--file", str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["matrix"] == {"cpu:0": [["eth9"], []]}
    bad = subprocess.run([sys.executable, "-m", "pymooncake", "transfer", "topology",
                          "--file", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.startswith("pymooncake: error: cannot read")


def test_device_addresses_for_binding_paths() -> None:
    assert device_ipv4("lo") == "127.0.0.1"
    assert device_ipv4("no-such-dev0") is None


def test_virtual_devices_are_skipped_and_unknown_numa_is_preferred_everywhere(
        tmp_path: Path) -> None:
    # A one-node VM: a virtio NIC without numa_node, plus lo and two ifb devices.
    (tmp_path / "devices/system/node/node0").mkdir(parents=True)
    (tmp_path / "class/net/eth0/device").mkdir(parents=True)  # no numa_node file
    for dev in ("lo", "ifb0", "ifb1"):
        (tmp_path / f"class/net/{dev}").mkdir(parents=True)
    topo = discover(tmp_path)
    assert topo.matrix == {"cpu:0": (("eth0",), ())}
    assert topo.virtual == ("ifb0", "ifb1", "lo")
    assert topo.to_json()["virtual"] == ["ifb0", "ifb1", "lo"]
    assert [topo.path_device("cpu:0", k) for k in range(2)] == ["eth0", "eth0"]
    # Only virtual devices: paths fall back to lo (unbound).
    only_virtual = tmp_path / "v"
    (only_virtual / "class/net/lo").mkdir(parents=True)
    topo2 = discover(only_virtual)
    assert topo2.matrix == {"cpu:0": ((), ())} and topo2.path_device("cpu:0", 0) == "lo"
