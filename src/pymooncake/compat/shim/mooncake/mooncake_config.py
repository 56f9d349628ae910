"""``mooncake.mooncake_config`` on pymooncake: ``MooncakeConfig``, the settings a Mooncake
client is set up with, from a JSON file (``MOONCAKE_CONFIG_PATH``) or the ``MOONCAKE_*``
environment variables, with Mooncake's field names, defaults and size strings
(``"16MB"``, ``"4g"``: binary multiples)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200  # 3.125 GiB, Mooncake's default
DEFAULT_LOCAL_BUFFER_SIZE = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40}
_TRUE = {"true", "1", "yes", "on", "enable"}
_FALSE = {"false", "0", "no", "off", "disable", ""}


def _size(value: Any) -> int:
    """Bytes from an int or a size string; ``ValueError`` for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    num = text.rstrip("kmgtb")
    unit = text[len(num):]
    if unit not in _UNITS or not num.strip():
        raise ValueError(f"Invalid segment size: {value!r}")
    return int(float(num) * _UNITS[unit])


def _flag(value: Any) -> bool:
    if isinstance(value, bool | int | float):
        return bool(value)
    if value is None:
        return False
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"Invalid boolean value: {value!r}")


@dataclass
class MooncakeConfig:
    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str | None
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(f"Invalid protocol: {self.protocol!r}")
        self.protocol = self.protocol.strip().lower()
        for name in ("global_segment_size", "local_buffer_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"Invalid {name}: {getattr(self, name)}. Size must be "
                                 f"non-negative.")
        for name in ("local_hostname", "metadata_server", "master_server_address"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"Config field {name!r} must be a non-empty string, "
                                 f"got {v!r}.")

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        with open(file_path) as f:
            cfg = json.load(f)
        for name in ("local_hostname", "metadata_server", "master_server_address"):
            if name not in cfg:
                raise ValueError(f"Missing required config field: {name}")
        return MooncakeConfig(
            local_hostname=cfg["local_hostname"], metadata_server=cfg["metadata_server"],
            global_segment_size=_size(cfg.get("global_segment_size",
                                              DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_size(cfg.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=cfg.get("protocol", "tcp"), device_name=cfg.get("device_name", ""),
            master_server_address=cfg["master_server_address"],
            enable_ssd_offload=_flag(cfg.get("enable_ssd_offload", False)),
            ssd_offload_path=str(cfg.get("ssd_offload_path") or ""),
            tenant_id=str(cfg.get("tenant_id") or "default"),
            enable_client_http_server=_flag(cfg.get("enable_client_http_server", False)),
            client_http_port=int(cfg.get("client_http_port", 9300)))

    @staticmethod
    def load_from_env() -> MooncakeConfig:
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path is not None:
            return MooncakeConfig.from_file(path)
        if not os.getenv("MOONCAKE_MASTER"):
            raise ValueError("Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor "
                             "'MOONCAKE_MASTER' is set.")
        env = os.getenv
        return MooncakeConfig(
            local_hostname=env("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=env("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=_size(env("MOONCAKE_GLOBAL_SEGMENT_SIZE",
                                          DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_size(env("MOONCAKE_LOCAL_BUFFER_SIZE",
                                        DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=env("MOONCAKE_PROTOCOL", "tcp"), device_name=env("MOONCAKE_DEVICE", ""),
            master_server_address=env("MOONCAKE_MASTER", ""),
            enable_ssd_offload=_flag(env("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=env("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=env("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=_flag(env("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER",
                                                "false")),
            client_http_port=int(env("MOONCAKE_CLIENT_HTTP_PORT", "9300")))
