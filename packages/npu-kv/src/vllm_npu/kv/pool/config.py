# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The KV pool's settings: the Mooncake store keys vllm-ascend reads from ``MOONCAKE_CONFIG_PATH`` (a JSON file),
overridable key by key in ``kv_connector_extra_config``.

Precedence: ``kv_connector_extra_config`` > the file named by ``kv_connector_extra_config.mooncake_config_path`` or
else by the ``MOONCAKE_CONFIG_PATH`` environment variable > the defaults below (vllm-ascend v0.11.0's,
``distributed/mooncake/config_data.py:MooncakeStoreConfig.from_file``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_npu.interface import ConfigError

#: The store keys (vllm-ascend's names) and their defaults; None: required or derived.
STORE_DEFAULTS: dict[str, Any] = {
    "local_hostname": None,  # default: this host's address (vllm.utils.get_ip)
    "metadata_server": "P2PHANDSHAKE",
    "master_server_address": None,  # required: "host:port" of mooncake_master
    "global_segment_size": 3355443200,  # bytes of host memory each worker lends to the pool
    "local_buffer_size": 1073741824,  # bytes of the client's own transfer buffer
    "protocol": "tcp",
    "device_name": "",
    # vllm-ascend's switch between its two NPU transfer paths; accepted so its files load, not used: this
    # connector always registers the KV cache itself and lets the store's transfer engine move it.
    "use_ascend_direct": False,
}
#: Our own extra keys (not in vllm-ascend's file).
EXTRA_DEFAULTS: dict[str, Any] = {
    "mooncake_config_path": None,
    # Seconds to wait for the master's TCP port before serving without the pool.
    "master_timeout_s": 3.0,
}
_INT_KEYS = ("global_segment_size", "local_buffer_size")


@dataclass(frozen=True)
class PoolConfig:
    """One instance's pool settings (see the module docstring for where each comes from)."""

    local_hostname: str
    metadata_server: str
    master_server_address: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str
    master_timeout_s: float

    @property
    def master_host_port(self) -> tuple[str, int]:
        host, _, port = self.master_server_address.rpartition(":")
        return host, int(port)


def _read_file(path: str, source: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"the Mooncake store config {path!r} ({source}) cannot be read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the Mooncake store config {path!r} ({source}) is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"the Mooncake store config {path!r} ({source}) must be a JSON object")
    return data


def pool_config(extra: dict[str, Any] | None, environ: dict[str, str] | None = None) -> PoolConfig:
    """The settings from ``kv_connector_extra_config`` (``extra``) and the environment; a missing master address,
    an unknown key or a bad value is a :class:`ConfigError` naming the key and the fix."""
    env = os.environ if environ is None else environ
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(STORE_DEFAULTS) - set(EXTRA_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has unknown keys {unknown} for the KV pool connector; known: "
            f"{sorted(set(STORE_DEFAULTS) | set(EXTRA_DEFAULTS))}"
        )
    values: dict[str, Any] = dict(STORE_DEFAULTS)
    path = extra.get("mooncake_config_path") or env.get("MOONCAKE_CONFIG_PATH")
    if path:
        source = (
            "kv_connector_extra_config.mooncake_config_path"
            if extra.get("mooncake_config_path")
            else ("MOONCAKE_CONFIG_PATH")
        )
        data = _read_file(str(path), source)
        bad = sorted(set(data) - set(STORE_DEFAULTS))
        if bad:
            raise ConfigError(f"{path} ({source}) has unknown keys {bad}; known: {sorted(STORE_DEFAULTS)}")
        values.update({k: v for k, v in data.items() if v is not None})
    values.update({k: v for k, v in extra.items() if k in STORE_DEFAULTS})
    master = values["master_server_address"]
    host, sep, port = str(master or "").rpartition(":")
    if not master or not sep or not host or not port.isdigit():
        raise ConfigError(
            f"the KV pool needs master_server_address as 'host:port' of a running mooncake_master, got {master!r}; "
            "set it in the MOONCAKE_CONFIG_PATH file or kv_connector_extra_config (start a pool with "
            "`vllm-npu kv-pool`)"
        )
    for key in _INT_KEYS:
        if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 0:
            raise ConfigError(f"{key} must be a number of bytes (an integer >= 0), got {values[key]!r}")
    timeout = extra.get("master_timeout_s", EXTRA_DEFAULTS["master_timeout_s"])
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"kv_connector_extra_config.master_timeout_s must be a positive number, got {timeout!r}")
    hostname = values["local_hostname"]
    if not hostname:
        from vllm.utils import get_ip

        hostname = get_ip()
    return PoolConfig(
        local_hostname=str(hostname),
        metadata_server=str(values["metadata_server"]),
        master_server_address=str(master),
        global_segment_size=int(values["global_segment_size"]),
        local_buffer_size=int(values["local_buffer_size"]),
        protocol=str(values["protocol"]).lower(),
        device_name=str(values["device_name"] or ""),
        master_timeout_s=float(timeout),
    )
