# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The connector's settings, read from vLLM's ``--kv-transfer-config`` (``kv_ip``, ``kv_port``,
``kv_connector_extra_config``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_npu.interface import ConfigError

#: ``kv_connector_extra_config`` keys this connector reads, with their defaults.
EXTRA_DEFAULTS: dict[str, float] = {
    # Seconds a prefill instance keeps a finished request's blocks for the decode side to pull; then frees them.
    "abort_timeout_s": 120.0,
    # Seconds a decode worker waits for one side-channel answer (handshake or done) from a prefill worker.
    "handshake_timeout_s": 10.0,
}


@dataclass(frozen=True)
class ConnectorSettings:
    host: str
    base_port: int
    abort_timeout_s: float
    handshake_timeout_s: float
    role: str

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")


def connector_settings(vllm_config: Any) -> ConnectorSettings:
    """The settings of this instance. The side-channel base port of a data-parallel rank ``d`` is
    ``kv_port + d * tensor_parallel_size`` (TP rank ``r`` listens on base + ``r``)."""
    kvc = vllm_config.kv_transfer_config
    extra = dict(kvc.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(EXTRA_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has unknown keys {unknown} for the Mooncake connector; "
            f"known: {sorted(EXTRA_DEFAULTS)}"
        )
    values = {}
    for key, default in EXTRA_DEFAULTS.items():
        value = extra.get(key, default)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"kv_connector_extra_config.{key} must be a positive number of seconds, got {value!r}")
        values[key] = float(value)
    par = vllm_config.parallel_config
    base = int(kvc.kv_port) + int(par.data_parallel_rank) * int(par.tensor_parallel_size)
    if kvc.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {kvc.kv_role!r}")
    return ConnectorSettings(
        str(kvc.kv_ip), base, values["abort_timeout_s"], values["handshake_timeout_s"], kvc.kv_role
    )
