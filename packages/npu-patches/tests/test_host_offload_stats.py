# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``host-offload-stats``: the host offload handler counts its finished transfers, vLLM's ``OffloadingConnector``
(patched) reports them as connector stats and rebuilds them from their serialized form, and ``kv-connector-metrics``
turns them into ``vllm:npu_kv_offload_*`` counters; vLLM 0.11.0's connector reports nothing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm_npu.patches.sets.host_offload import HostOffloadHandler

_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"


def _handler() -> HostOffloadHandler:
    """GQA cache of 8 device blocks of 4 tokens, 2 KV heads x 8 float32 (two layers), host blocks of 8 tokens."""
    caches = {"l0": torch.randn(2, 8, 4, 2, 8), "l1": torch.randn(2, 8, 4, 2, 8)}
    return HostOffloadHandler(caches, 4, 8, num_cpu_blocks=4, kv_lora_rank=None)


_BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4  # layers x (K, V) x tokens x heads x head size x float32


def _transfer(handler: HostOffloadHandler) -> None:
    from vllm.v1.kv_offload.mediums import CPULoadStoreSpec as cpu
    from vllm.v1.kv_offload.mediums import GPULoadStoreSpec as gpu

    handler.transfer_async(1, (gpu([2, 3, 6, 7]), cpu([0, 3])))  # 4 device blocks stored
    handler.transfer_async(2, (cpu([3]), gpu([0, 1])))  # 2 device blocks loaded (a hit)
    assert sorted(handler.get_finished()) == [(1, True), (2, True)]


def test_handler_counts_finished_transfers() -> None:
    handler = _handler()
    assert handler.block_bytes == _BLOCK_BYTES
    _transfer(handler)
    assert handler.take_counts() == {
        "loaded_blocks": 2,
        "loaded_bytes": 2 * _BLOCK_BYTES,
        "loaded_tokens": 8,
        "stored_blocks": 4,
        "stored_bytes": 4 * _BLOCK_BYTES,
        "stored_tokens": 16,
    }
    assert not any(handler.take_counts().values())  # an interval's counts are handed over once


def _connector(cls: type, handler: Any) -> Any:
    connector = object.__new__(cls)
    connector.connector_worker = SimpleNamespace(spec=SimpleNamespace(_handler=handler))
    return connector


def test_vllm_0_11_0_offloading_connector_reports_no_stats() -> None:
    """Without the patch: the connector's stats seams are the base class's (None)."""
    import importlib

    vllm_cls = importlib.import_module(_MODULE).OffloadingConnector
    vllm_cls = getattr(vllm_cls, "__wrapped__", vllm_cls)
    handler = _handler()
    _transfer(handler)
    assert _connector(vllm_cls, handler).get_kv_connector_stats() is None
    assert vllm_cls.build_kv_connector_stats({"loaded_blocks": 2}) is None


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> type:
    """vLLM's module holding the patched class, as the platform hook leaves it."""
    import importlib

    from vllm_npu.patches.sets.host_offload_stats import make_replacement

    module = importlib.import_module(_MODULE)
    original = getattr(module.OffloadingConnector, "__wrapped__", module.OffloadingConnector)
    cls = make_replacement(original)
    monkeypatch.setattr(module, "OffloadingConnector", cls)
    return cls


def test_connector_reports_and_rebuilds_the_handler_counts(patched: type) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    assert patched.__name__ == "OffloadingConnector" and issubclass(patched, KVConnectorBase_V1)
    assert issubclass(patched, patched.__wrapped__)  # type: ignore[attr-defined]
    handler = _handler()
    connector = _connector(patched, handler)
    assert connector.get_kv_connector_stats() is None  # nothing finished: no stats this step, as vLLM's connectors
    _transfer(handler)
    stats = connector.get_kv_connector_stats()
    assert isinstance(stats, KVConnectorStats) and stats.data["loaded_blocks"] == 2
    assert connector.get_kv_connector_stats() is None
    assert _connector(patched, None).get_kv_connector_stats() is None  # CUDA handler / scheduler side
    # the API server's side: the class the factory finds by name rebuilds the serialized data, aggregates it
    found = KVConnectorFactory.get_connector_class(SimpleNamespace(kv_connector="OffloadingConnector"))
    assert found is patched
    again = found.build_kv_connector_stats(dict(stats.data)).aggregate(found.build_kv_connector_stats(stats.data))
    assert again.data["loaded_bytes"] == 4 * _BLOCK_BYTES and again.data["stored_tokens"] == 32
    assert again.reduce()["offload hit blocks"] == 4


def test_offload_stats_become_counters(patched: type) -> None:
    import functools

    from prometheus_client import CollectorRegistry, Counter
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm_npu.patches.sets.kv_connector_metrics import make_replacement

    registry = CollectorRegistry()
    stat_logger = object.__new__(PrometheusStatLogger)
    stat_logger.vllm_config = SimpleNamespace(  # type: ignore[assignment]
        kv_transfer_config=SimpleNamespace(kv_connector="OffloadingConnector"),
        model_config=SimpleNamespace(served_model_name="tiny"),
    )
    stat_logger._counter_cls = functools.partial(Counter, registry=registry)  # type: ignore[assignment,misc]
    record = make_replacement(lambda self, s, i, e=0: None)
    handler = _handler()
    _transfer(handler)
    data = _connector(patched, handler).get_kv_connector_stats().data  # what SchedulerStats carries
    for _ in range(2):
        record(stat_logger, SchedulerStats(kv_connector_stats=dict(data)), None, 0)

    def value(name: str) -> Any:
        return registry.get_sample_value(f"vllm:npu_kv_offload_{name}_total", {"model_name": "tiny", "engine": "0"})

    assert value("loaded_blocks") == 4 and value("loaded_bytes") == 4 * _BLOCK_BYTES
    assert value("loaded_tokens") == 16
    assert value("stored_blocks") == 8 and value("stored_bytes") == 8 * _BLOCK_BYTES and value("stored_tokens") == 32
