# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""What the scheduler half of the connector tells the workers each step, and what the workers report back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .params import RemotePrefill


@dataclass(frozen=True)
class RecvTask:
    """Pull the prompt KV into ``local_block_ids`` (the request's blocks vLLM has not filled from its own prefix
    cache; empty when it has all of them) from ``remote``."""

    local_block_ids: tuple[int, ...]
    remote: RemotePrefill


@dataclass
class MooncakeConnectorMetadata(KVConnectorMetadata):
    #: decode side: requests to pull this step
    reqs_to_recv: dict[str, RecvTask] = field(default_factory=dict)
    #: prefill side: requests whose blocks are held for a decode instance, with the monotonic time they expire
    reqs_to_send: dict[str, float] = field(default_factory=dict)


@dataclass
class MooncakeTransferStats(KVConnectorStats):
    """Per-interval transfer telemetry of the workers: ``failed`` request ids (their loads failed and are
    recomputed), ``bytes`` and ``seconds`` pulled, ``transfers`` (requests pulled)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"failed": [], "bytes": 0, "seconds": 0.0, "transfers": 0, "expired": 0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            d = other.data
            self.data["failed"] = sorted(set(self.data["failed"]) | set(d.get("failed", ())))
            for key in ("bytes", "seconds", "transfers", "expired"):
                self.data[key] += d.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["seconds"]
        return {
            "transfers": self.data["transfers"],
            "failed": len(self.data["failed"]),
            "expired": self.data["expired"],
            "MB pulled": round(self.data["bytes"] / 1e6, 3),
            "MB/s": round(self.data["bytes"] / 1e6 / seconds, 1) if seconds else 0.0,
        }

    def is_empty(self) -> bool:
        return not (self.data["failed"] or self.data["transfers"] or self.data["expired"])

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> MooncakeTransferStats:
        return cls(data=dict(data)) if data else cls()


def failed_request_ids(stats: KVConnectorStats | None, connector: str) -> list[str]:
    """The request ids whose load failed, from the step's connector stats: ``stats.data["failed"]`` when the
    connector runs alone, or the ``connector`` entry's when it runs inside vLLM's ``MultiConnector`` (whose stats
    are keyed by connector class name; an entry may arrive as a stats object or as its plain ``data`` dict)."""
    if stats is None:
        return []
    data = stats.data
    if "failed" in data:
        return list(data["failed"] or ())
    inner = data.get(connector)
    if isinstance(inner, KVConnectorStats):
        inner = inner.data
    if isinstance(inner, dict) and set(inner) == {"data"}:  # a stats object's msgpack form
        inner = inner["data"]
    if isinstance(inner, dict):
        return list(inner.get("failed") or ())
    return []
