# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The quant layer's component declaration. Imports nothing but npu-interface: discovery must stay cheap."""

from vllm_npu.interface import SUPPORTED_VLLM, Component

from ._version import __version__

COMPONENT = Component(
    name="quant",
    distribution="npu-quant",
    version=__version__,
    interface=">=1.0,<2",
    vllm=SUPPORTED_VLLM,
    summary="the `ascend` quantization method for msModelSlim checkpoints",
    on_load="vllm_npu.quant._hooks:on_load",
)

# What vLLM's `vllm.general_plugins` loader calls (entry point `npu_quant`).
load_plugin = COMPONENT.plugin_entry()
