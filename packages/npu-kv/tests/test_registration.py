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
