# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A slim deployment imports only what serves: on an NPU configuration, what a vLLM process loads of ours (the
platform hook and class, every layer's plugin hook, the worker, the model runner and its graph counters, the quant
method) imports none of the offline tooling (``vllm_npu.platform.tools``: the ``vllm-npu`` command and the demo;
``vllm_npu.quant.tools``: the quantizer and its simulation) and not the emulated device's graph twin
(``vllm_npu.platform.graphs.emulated``).

The static half is import-linter's "what serves never imports the offline tools" contract (root ``pyproject.toml``,
``tests/test_layering.py``); this test covers what the contract cannot list (the doors, lazy imports taken at run
time). The NPU is the stand-in torch_npu of :mod:`npu_testkit.npu_runtime_standin` and a probe that reports one
device, so the platform resolves to ``NPUPlatform`` with the ``NPUDevice`` backend, as on an Ascend host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_SERVE = textwrap.dedent(
    """
    import json, sys
    from npu_testkit.npu_runtime_standin import install
    install()
    from vllm_npu.interface import device
    device.probe_npu = lambda environ=None, dev_glob="": device.NPUProbe(True, True, ("/dev/davinci0",), None)

    import vllm_npu.platform
    assert vllm_npu.platform.register() == "vllm_npu.platform.platform.NPUPlatform"
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # every layer's plugin hook, as each vLLM process runs them

    import vllm_npu.platform.worker
    from vllm_npu.platform._device import NPUDevice, device_backend
    from vllm_npu.platform.graphs.torchair import TORCHAIR_STATS
    from vllm_npu.platform.graphs.wrapper import GRAPH_STATS
    from vllm_npu.quant import AscendQuantConfig
    import vllm_npu.quant.linear_method, vllm_npu.quant.moe_method

    assert current_platform.device_backend is NPUDevice and device_backend() is NPUDevice
    # What the model runner does when it is built, and the worker when asked for its runtime info.
    GRAPH_STATS.reset()
    GRAPH_STATS.snapshot()
    TORCHAIR_STATS.snapshot()
    assert AscendQuantConfig.get_name() == "ascend"
    offline = ("vllm_npu.platform.tools", "vllm_npu.quant.tools", "vllm_npu.platform.graphs.emulated")
    print("@@LOADED@@" + json.dumps(sorted(m for m in sys.modules if m.startswith(offline))))
    """
)


def test_serving_on_an_npu_imports_no_offline_tool_and_no_emulated_twin() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_NPU_", "VLLM_PLUGINS"))}
    env.update(VLLM_NPU_DEVICE="npu", VLLM_NO_USAGE_STATS="1")
    proc = subprocess.run([sys.executable, "-c", _SERVE], capture_output=True, text=True, timeout=300, env=env)
    _, sep, loaded = proc.stdout.rpartition("@@LOADED@@")
    assert sep, proc.stderr[-3000:]
    assert json.loads(loaded) == []
