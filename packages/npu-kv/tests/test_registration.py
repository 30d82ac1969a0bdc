# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The general plugin `npu_kv_connector` registers the connector with vLLM's factory, once and lazily; a missing
Mooncake engine is an error naming the wheels and the apt line."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
from vllm_npu.kv._component import COMPONENT
from vllm_npu.kv.engine import APT_LINE, MooncakeUnavailableError, TransferEngineHandle


def test_entry_point_and_component() -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps["npu_kv_connector"] == "vllm_npu.kv._component:load_plugin"
    assert COMPONENT.plugin_name == "npu_kv_connector" and COMPONENT.name == "kv"


def test_plugin_registers_the_connector_lazily_and_once() -> None:
    code = (
        "import os, sys\n"
        "os.environ['VLLM_NPU_DEVICE'] = 'emulated'\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "assert 'vllm_npu.kv.connector' not in sys.modules, 'registration imported the connector'\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "from vllm.config import KVTransferConfig\n"
        "for name in ('MooncakeConnector', 'MooncakeConnectorV1'):\n"
        "    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector=name, kv_role='kv_both'))\n"
        "    print(name, cls.__module__, cls.__name__)\n"
        "from vllm_npu.kv import register\n"
        "print('again', register())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("Mooncake", "again"))]
    assert lines == [
        "MooncakeConnector vllm_npu.kv.connector MooncakeConnector",
        "MooncakeConnectorV1 vllm_npu.kv.connector MooncakeConnector",
        "again []",
    ]


def test_missing_engine_names_the_packages_and_the_apt_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import of it raises ImportError
    with pytest.raises(MooncakeUnavailableError) as info:
        TransferEngineHandle("127.0.0.1", "tcp")
    msg = str(info.value)
    assert 'pip install "npu-platform[kv-ascend]"' in msg and 'pip install "npu-platform[kv-emulated]"' in msg
    assert "mooncake-transfer-engine-non-cuda" in msg and "mooncake-transfer-engine-npu" in msg
    assert APT_LINE == "apt-get install -y libibverbs1 librdmacm1 libnuma1" and APT_LINE in msg
    assert isinstance(info.value, ImportError)


def test_select_scheduler() -> None:
    from vllm_npu.kv import select_scheduler

    pd = "vllm_npu.kv.scheduler.PDScheduler"
    assert select_scheduler("MooncakeConnector", "vllm.v1.core.sched.scheduler.Scheduler") == pd
    assert select_scheduler("MooncakeConnectorV1", "vllm.core.scheduler.Scheduler") == pd
    # An explicit or async scheduler, or another connector, is left alone.
    async_cls = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    assert select_scheduler("MooncakeConnector", async_cls) == async_cls
    assert select_scheduler("NixlConnector", "vllm.v1.core.sched.scheduler.Scheduler") != pd
    assert select_scheduler(None, "x.Y") == "x.Y"
    # The KV pool's names, and ours inside vLLM's MultiConnector (PD + pool)
    assert select_scheduler("MooncakeStoreConnector", "vllm.v1.core.sched.scheduler.Scheduler") == pd
    assert select_scheduler("MooncakeConnectorStoreV1", "vllm.v1.core.sched.scheduler.Scheduler") == pd
    multi = ["MooncakeConnector", "MooncakeStoreConnector"]
    assert select_scheduler("MultiConnector", "vllm.v1.core.sched.scheduler.Scheduler", multi) == pd
    assert select_scheduler("MultiConnector", "vllm.v1.core.sched.scheduler.Scheduler", ["NixlConnector"]) != pd


def test_failed_loads_are_found_alone_and_inside_a_multi_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats
    from vllm_npu.kv.metadata import MooncakeTransferStats, failed_request_ids
    from vllm_npu.kv.pool.stats import PoolStats

    pd_stats = MooncakeTransferStats()
    pd_stats.data["failed"] = ["r1"]
    pool_stats = PoolStats()
    pool_stats.data["failed"] = ["r2"]
    assert failed_request_ids(pd_stats, "MooncakeConnector") == ["r1"]
    multi = MultiKVConnectorStats(data={"MooncakeConnector": pd_stats, "MooncakeStoreConnector": pool_stats})
    assert failed_request_ids(multi, "MooncakeConnector") == ["r1"]
    assert failed_request_ids(multi, "MooncakeStoreConnector") == ["r2"]
    # after a process boundary an entry may be its plain data dict
    assert failed_request_ids(
        MultiKVConnectorStats(data={"MooncakeStoreConnector": {"failed": ["r3"]}}), "MooncakeStoreConnector"
    ) == ["r3"]
    assert failed_request_ids(None, "MooncakeConnector") == []


def test_pd_scheduler_recomputes_a_failed_pool_load_inside_a_multi_connector() -> None:
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm_npu.kv.connector import MooncakeConnector
    from vllm_npu.kv.pool.connector import MooncakeStoreConnector
    from vllm_npu.kv.scheduler import PDScheduler

    pool = object.__new__(MooncakeStoreConnector)
    pool._failed = {"r1"}
    pd = object.__new__(MooncakeConnector)
    pd.scheduler = None  # a load_failed call on it would fail: it has no failure for r1 to report
    pd.load_failed = lambda req_id: False  # type: ignore[method-assign]
    multi = object.__new__(MultiConnector)
    multi._connectors = [pd, pool]  # where vLLM's MultiConnector keeps its connectors
    freed: list[object] = []
    fake = SimpleNamespace(
        connector=multi,
        finished_recving_kv_req_ids={"r1"},
        kv_cache_manager=SimpleNamespace(free=freed.append),
    )
    request = SimpleNamespace(request_id="r1", num_computed_tokens=160)
    assert PDScheduler._update_waiting_for_remote_kv(fake, request) is True  # type: ignore[arg-type]
    assert freed == [request] and request.num_computed_tokens == 0 and fake.finished_recving_kv_req_ids == set()
    assert pool.load_failed("r1") is False  # asked once


def test_platform_selects_the_pd_scheduler_for_ours_inside_a_multi_connector() -> None:
    from types import SimpleNamespace

    from vllm_npu.platform.platform import NPUPlatform

    def config(kv_connector: str, extra: dict[str, object]) -> SimpleNamespace:
        return SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector=kv_connector, kv_connector_extra_config=extra),
            scheduler_config=SimpleNamespace(scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler"),
        )

    # config stubs only: nothing here loads Mooncake (tests/test_system_libs.py looks for the engine config literal)
    subs = {"connectors": [{"kv_connector": name} for name in ("MooncakeConnector", "MooncakeStoreConnector")]}
    multi = config("MultiConnector", subs)
    NPUPlatform._select_pd_scheduler(multi)  # type: ignore[arg-type]
    assert multi.scheduler_config.scheduler_cls == "vllm_npu.kv.scheduler.PDScheduler"
    other = config("MultiConnector", {"connectors": [{"kv_connector": "NixlConnector"}]})
    NPUPlatform._select_pd_scheduler(other)  # type: ignore[arg-type]
    assert other.scheduler_config.scheduler_cls == "vllm.v1.core.sched.scheduler.Scheduler"
