# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The pool connector's per-interval telemetry (vLLM's ``KVConnectorStats``): vLLM 0.11 aggregates it over the
workers and logs it ("KV Transfer metrics: ..."); npu-patches' ``kv-connector-metrics`` adds
:meth:`PoolStats.prometheus_counters` to vLLM's ``/metrics``; its ``failed`` request ids also tell the scheduler
which loads to recompute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_COUNTERS = (
    "loaded_blocks",
    "loaded_bytes",
    "load_seconds",
    "stored_blocks",
    "stored_bytes",
    "store_errors",
    "store_seconds",
)


@dataclass
class PoolStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"failed": [], **{k: 0 for k in _COUNTERS}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            d = other.data
            self.data["failed"] = sorted(set(self.data["failed"]) | set(d.get("failed", ())))
            for key in _COUNTERS:
                self.data[key] += d.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {
            "pool hit blocks": d["loaded_blocks"],
            "failed loads": len(d["failed"]),
            "MB loaded": round(d["loaded_bytes"] / 1e6, 3),
            "blocks stored": d["stored_blocks"],
            "MB stored": round(d["stored_bytes"] / 1e6, 3),
            "store errors": d["store_errors"],
        }

    def prometheus_counters(self) -> dict[str, tuple[str, float]]:
        """Prometheus counter name (without vLLM's ``vllm:`` prefix) -> (help, this interval's increment)."""
        d = self.data
        return {
            "npu_kv_pool_hit_blocks": ("KV blocks loaded from the pool (prefix hits).", d["loaded_blocks"]),
            "npu_kv_pool_loaded_bytes": ("Bytes of KV cache loaded from the pool.", d["loaded_bytes"]),
            "npu_kv_pool_stored_blocks": ("KV blocks stored into the pool.", d["stored_blocks"]),
            "npu_kv_pool_stored_bytes": ("Bytes of KV cache stored into the pool.", d["stored_bytes"]),
            "npu_kv_pool_failed_loads": ("Requests whose pool load failed (recomputed).", len(d["failed"])),
            "npu_kv_pool_store_errors": ("KV blocks whose store into the pool failed (not kept).", d["store_errors"]),
        }

    def is_empty(self) -> bool:
        d = self.data
        return not (d["failed"] or any(d[k] for k in _COUNTERS))

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> PoolStats:
        return cls(data={**cls().data, **dict(data)}) if data else cls()
