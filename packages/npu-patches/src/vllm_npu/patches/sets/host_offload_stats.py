# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``host-offload-stats``: vLLM's ``OffloadingConnector`` reports its transfers as connector stats, so host
offload hits reach vLLM's ``/metrics`` (``vllm:npu_kv_offload_*``, through ``kv-connector-metrics``).

vLLM 0.11.0's ``OffloadingConnector`` inherits ``KVConnectorBase_V1.get_kv_connector_stats`` and
``build_kv_connector_stats``, which both return None: its transfers never reach ``SchedulerStats`` (nor the "KV
Transfer metrics" log line). The two seams live in two processes (the worker reports, the API server rebuilds the
serialized stats by the connector's class), and a patch replaces one attribute, so the target is the class: the
replacement is a subclass of vLLM's with the same name and module, found by ``KVConnectorFactory`` (it imports the
module and reads the class by name when the connector is built), adding only those two methods.
:meth:`get_kv_connector_stats` takes the counts of ``host-offload-npu``'s :class:`HostOffloadHandler` (the handler the
spec built for this worker); with vLLM's own CUDA handler there is none and it reports None, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .host_offload import COUNTS

_HELP = {
    "loaded_blocks": "KV blocks loaded from host memory (host offload hits), in device blocks.",
    "loaded_bytes": "Bytes of KV cache loaded from host memory (host offload hits).",
    "loaded_tokens": "Tokens whose KV cache was loaded from host memory (host offload hits).",
    "stored_blocks": "KV blocks stored to host memory, in device blocks.",
    "stored_bytes": "Bytes of KV cache stored to host memory.",
    "stored_tokens": "Tokens whose KV cache was stored to host memory.",
}


@dataclass
class HostOffloadStats(KVConnectorStats):
    """One interval's host offload transfers (finished jobs), summed over the workers: :data:`COUNTS` -> int."""

    def __post_init__(self) -> None:
        self.data = {**dict.fromkeys(COUNTS, 0), **(self.data or {})}

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in COUNTS:
            self.data[key] += other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {
            "offload hit blocks": d["loaded_blocks"],
            "MB loaded": round(d["loaded_bytes"] / 1e6, 3),
            "blocks offloaded": d["stored_blocks"],
            "MB offloaded": round(d["stored_bytes"] / 1e6, 3),
        }

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in COUNTS)

    def prometheus_counters(self) -> dict[str, tuple[str, float]]:
        """Prometheus counter name (without vLLM's ``vllm:`` prefix) -> (help, this interval's increment)."""
        return {f"npu_kv_offload_{key}": (_HELP[key], self.data[key]) for key in COUNTS}


class ReportsHostOffloadStats:
    """The two methods the replacement adds in front of vLLM's ``OffloadingConnector`` (a top-level class, so the
    vLLM-surface scan sees it; :func:`make_replacement` puts it first in the subclass's bases)."""

    def get_kv_connector_stats(self) -> HostOffloadStats | None:
        worker = getattr(self, "connector_worker", None)
        handler = getattr(getattr(worker, "spec", None), "_handler", None)
        if handler is None:  # scheduler side, or vLLM's own (CUDA) handler
            return None
        stats = HostOffloadStats(data=handler.take_counts())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HostOffloadStats:
        return HostOffloadStats(data=dict(data) if data else {})


def make_replacement(original: type) -> type:
    """Build ``OffloadingConnector``: vLLM's, reporting :class:`HostOffloadStats` (same name, module and docs)."""
    namespace = {
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
        "__wrapped__": original,
    }
    return type(original.__name__, (ReportsHostOffloadStats, original), namespace)
