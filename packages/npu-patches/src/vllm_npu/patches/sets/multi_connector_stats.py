# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``multi-connector-stats``: vLLM's ``MultiConnector`` stats survive the trip to the API server.

vLLM 0.11.0 sends the engine's ``SchedulerStats.kv_connector_stats`` (a ``MultiKVConnectorStats``' ``data``:
connector class name -> that connector's stats) to the API server, where msgpack turns each per-connector stats
object into a plain dict. ``KVConnectorLogging.observe`` rebuilds only the outer object
(``MultiConnector.build_kv_connector_stats`` -> ``MultiKVConnectorStats(data=data)``), so the second observation's
``aggregate`` calls ``.aggregate`` on a dict: the API server's output handler dies (``AttributeError: 'dict' object
has no attribute 'aggregate'``) and every later request fails with HTTP 500. Any ``MultiConnector`` whose connectors
report stats hits it (e.g. npu-kv's PD connector + KV pool), with stats logging on (``vllm serve``'s default).

The replacement rebuilds each entry with its connector class's own ``build_kv_connector_stats`` (the class found
with vLLM's ``KVConnectorFactory.get_connector_class`` by the name the entry is keyed by); an entry it cannot
rebuild is dropped from the log, never raised.
"""

from __future__ import annotations

from typing import Any

from vllm_npu.interface import get_logger

logger = get_logger(__name__)


def revive(name: str, value: Any) -> Any:
    """``value`` (a stats object, or its msgpack form: a dict, with or without the ``data`` field) as the stats object
    of the connector class ``name``; None when no registered connector of that name can build it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    if isinstance(value, KVConnectorStats):
        return value
    if not isinstance(value, dict):
        return None
    data = value.get("data", value) if set(value) <= {"data"} else value
    from vllm.config import KVTransferConfig

    try:
        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector=name, kv_role="kv_both"))
    except Exception:  # not a registered connector name
        return None
    try:
        stats = cls.build_kv_connector_stats(data=data)
    except Exception as exc:  # a connector that cannot rebuild its own stats: leave it out of the log
        logger.warning("KV connector %s: its stats could not be rebuilt (%s); not logged", name, exc)
        return None
    return stats


def make_replacement(original: Any) -> Any:
    """Build ``MultiConnector.build_kv_connector_stats`` (a classmethod, as vLLM's) rebuilding every entry."""
    func = original.__func__

    def build_kv_connector_stats(cls: type, data: dict[str, Any] | None = None) -> Any:
        if data:
            revived = {name: revive(name, value) for name, value in data.items()}
            data = {name: stats for name, stats in revived.items() if stats is not None}
        return func(cls, data)

    build_kv_connector_stats.__module__ = func.__module__
    build_kv_connector_stats.__qualname__ = func.__qualname__
    build_kv_connector_stats.__wrapped__ = func  # type: ignore[attr-defined]
    return classmethod(build_kv_connector_stats)
