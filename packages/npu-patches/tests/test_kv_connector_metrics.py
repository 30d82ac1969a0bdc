# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``kv-connector-metrics``: the KV pool's stats (alone, or as a MultiConnector entry next to the PD connector) become
Prometheus counters ``vllm:npu_kv_pool_*`` with vLLM's labels; vLLM 0.11.0's ``PrometheusStatLogger.record`` drops
them."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest


def _logger(kv_connector: str | None) -> tuple[Any, Any]:
    """A PrometheusStatLogger without its vLLM metrics (vLLM's record needs a VllmConfig; only ours is under test),
    counting into a private registry."""
    from prometheus_client import CollectorRegistry, Counter
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    registry = CollectorRegistry()
    stat_logger = object.__new__(PrometheusStatLogger)
    stat_logger.vllm_config = SimpleNamespace(  # type: ignore[assignment]
        kv_transfer_config=SimpleNamespace(kv_connector=kv_connector) if kv_connector else None,
        model_config=SimpleNamespace(served_model_name="tiny"),
    )
    stat_logger._counter_cls = functools.partial(Counter, registry=registry)  # type: ignore[assignment,misc]
    return stat_logger, registry


def _step(kv_connector_stats: Any) -> Any:
    from vllm.v1.metrics.stats import SchedulerStats

    return SchedulerStats(kv_connector_stats=kv_connector_stats)


_POOL = {"failed": ["r1"], "loaded_blocks": 3, "loaded_bytes": 3000, "stored_blocks": 2, "stored_bytes": 2000}


def _record(kv_connector: str | None, steps: list[Any]) -> Any:
    from vllm_npu.kv import register
    from vllm_npu.patches.sets.kv_connector_metrics import make_replacement

    register()  # the connector names, as the kv component's hook registers them in every process
    stat_logger, registry = _logger(kv_connector)
    vllm_record = []  # vLLM's own record (stubbed: it needs the metrics vLLM's __init__ builds)
    record = make_replacement(lambda self, s, i, e=0: vllm_record.append(e))
    for engine, stats in steps:
        record(stat_logger, _step(stats), None, engine)
    assert len(vllm_record) == len(steps)
    return registry


def _value(registry: Any, name: str, engine: str = "0") -> Any:
    return registry.get_sample_value(f"vllm:{name}_total", {"model_name": "tiny", "engine": engine})


def test_vllm_0_11_0_drops_connector_stats() -> None:
    """Without the patch: vLLM's PrometheusStatLogger.record never looks at kv_connector_stats."""
    import inspect

    from vllm.v1.metrics.loggers import PrometheusStatLogger

    assert "kv_connector_stats" not in inspect.getsource(PrometheusStatLogger.record)


@pytest.mark.parametrize("connector", ["MooncakeStoreConnector", "MooncakeConnectorStoreV1"])
def test_pool_stats_become_counters(connector: str) -> None:
    registry = _record(connector, [(0, _POOL), (0, _POOL), (1, {**_POOL, "store_errors": 4})])
    assert _value(registry, "npu_kv_pool_hit_blocks") == 6
    assert _value(registry, "npu_kv_pool_loaded_bytes") == 6000
    assert _value(registry, "npu_kv_pool_stored_blocks") == 4
    assert _value(registry, "npu_kv_pool_stored_bytes") == 4000
    assert _value(registry, "npu_kv_pool_failed_loads") == 2
    assert _value(registry, "npu_kv_pool_store_errors", engine="1") == 4
    assert _value(registry, "npu_kv_pool_hit_blocks", engine="1") == 3


def test_multi_connector_entries_are_unpacked() -> None:
    """PD + pool: the MultiConnector's entries in their msgpack form (plain dicts, with or without ``data``)."""
    pd = {"data": {"num_successful_transfers": 1}}
    registry = _record(
        "MultiConnector",
        [
            (0, {"MooncakeConnectorV1": pd, "MooncakeStoreConnector": {"data": _POOL}}),
            (0, {"MooncakeStoreConnector": _POOL, "NoSuchConnector": {"x": 1}}),
        ],
    )
    assert _value(registry, "npu_kv_pool_hit_blocks") == 6
    assert _value(registry, "npu_kv_pool_stored_bytes") == 4000


def test_no_connector_or_bad_stats_never_break_record() -> None:
    registry = _record(None, [(0, None), (0, _POOL)])
    assert _value(registry, "npu_kv_pool_hit_blocks") is None
    # a stats dict its connector cannot rebuild: logged, vLLM's record already ran, nothing raised
    registry = _record("MooncakeStoreConnector", [(0, {"loaded_blocks": "many"})])
    assert not _value(registry, "npu_kv_pool_hit_blocks")
