# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``kv-connector-metrics``: the KV connectors' stats on vLLM's ``/metrics``.

vLLM 0.11.0 gives ``SchedulerStats.kv_connector_stats`` (the connector stats of one engine step, summed over the
workers, in their serialized form) only to its logging stat logger (``LoggingStatLogger.record`` ->
``KVConnectorLogging``: the "KV Transfer metrics" log line); ``PrometheusStatLogger.record`` ignores them, and
``vllm serve`` cannot add a stat logger (``AsyncLLM.from_vllm_config(stat_loggers=)`` is not reachable from the
command line). The replacement runs vLLM's ``record``, then rebuilds the connector stats with the configured
connector class's ``build_kv_connector_stats`` (every ``MultiConnector`` entry with its own connector class, so PD +
pool is unpacked) and adds each stats object's ``prometheus_counters()`` (metric name -> (help, increment); npu-kv's
``PoolStats`` declares ``npu_kv_pool_*``) to Prometheus counters named ``vllm:<name>`` with vLLM's labels
``model_name`` and ``engine``. Stats without ``prometheus_counters`` are skipped; a counter appears on the first
step that reports its connector's stats. A failure here is logged once and never breaks vLLM's own metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vllm_npu.interface import get_logger

from .multi_connector_stats import revive

logger = get_logger(__name__)

_ATTR = "_vllm_npu_kv_counters"  # per PrometheusStatLogger: metric name -> the Counter (with labels model, engine)
_MULTI = "MultiConnector"


def connector_stats(kv_connector: str | None, data: dict[str, Any] | None) -> Iterator[Any]:
    """The stats objects in one step's ``kv_connector_stats`` (``data``) of the connector named ``kv_connector``:
    one per ``MultiConnector`` entry (each rebuilt by its own connector class), else the one connector's."""
    if not kv_connector or not data:
        return
    if kv_connector == _MULTI:
        entries = data.get("data", data) if set(data) <= {"data"} else data
        for name, value in entries.items():
            stats = revive(name, value)
            if stats is not None:
                yield stats
        return
    stats = revive(kv_connector, data)
    if stats is not None:
        yield stats


def observe(stat_logger: Any, kv_connector_stats: dict[str, Any] | None, engine_idx: int) -> None:
    """Add one step's connector stats to ``stat_logger``'s (a ``PrometheusStatLogger``) npu counters, creating each
    counter (``stat_logger._counter_cls``, labels model_name and engine) on first use."""
    config = stat_logger.vllm_config
    kv_config = config.kv_transfer_config
    kv_connector = kv_config.kv_connector if kv_config is not None else None
    counters: dict[str, Any] = stat_logger.__dict__.setdefault(_ATTR, {})
    labels = (config.model_config.served_model_name, str(engine_idx))
    for stats in connector_stats(kv_connector, kv_connector_stats):
        declared = getattr(stats, "prometheus_counters", None)
        if declared is None:
            continue
        for name, (documentation, increment) in declared().items():
            counter = counters.get(name)
            if counter is None:
                counter = counters[name] = stat_logger._counter_cls(
                    name=f"vllm:{name}", documentation=documentation, labelnames=["model_name", "engine"]
                )
            if increment:
                counter.labels(*labels).inc(increment)


def make_replacement(original: Any) -> Any:
    """Build ``PrometheusStatLogger.record``: vLLM's, then the KV connector counters."""

    def record(self: Any, scheduler_stats: Any, iteration_stats: Any, engine_idx: int = 0) -> None:
        original(self, scheduler_stats, iteration_stats, engine_idx)
        if scheduler_stats is None or not scheduler_stats.kv_connector_stats:
            return
        try:
            observe(self, scheduler_stats.kv_connector_stats, engine_idx)
        except Exception as exc:  # a metrics fault must never take the API server's output handler down
            if not self.__dict__.get("_vllm_npu_kv_warned"):
                self._vllm_npu_kv_warned = True
                logger.warning("KV connector stats not exported to Prometheus: %s", exc)

    record.__module__ = original.__module__
    record.__qualname__ = original.__qualname__
    record.__doc__ = original.__doc__
    record.__wrapped__ = original  # type: ignore[attr-defined]
    return record
