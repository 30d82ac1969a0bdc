# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The ops layer's component declaration. Imports nothing but npu-interface: discovery must stay cheap."""

from vllm_npu.interface import SUPPORTED_VLLM, Component

from ._version import __version__

COMPONENT = Component(
    name="ops",
    distribution="npu-ops",
    version=__version__,
    interface=">=1.0,<2",
    vllm=SUPPORTED_VLLM,
    summary="CustomOp overrides (norms, RoPE, activations, embedding, FusedMoE)",
    on_load="vllm_npu.ops._hooks:on_load",
)

# What vLLM's `vllm.general_plugins` loader calls (entry point `npu_ops`).
load_plugin = COMPONENT.plugin_entry()
