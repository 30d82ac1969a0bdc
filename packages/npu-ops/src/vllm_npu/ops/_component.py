# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The ops layer's component declaration. Imports nothing but npu-interface: discovery must stay cheap."""

from vllm_npu.interface import Component

from ._version import __version__

COMPONENT = Component(
    name="ops",
    distribution="npu-ops",
    version=__version__,
    interface=">=1.0,<2",
    vllm=">=0.11.0,<0.12",
    summary="CustomOp overrides (norms, RoPE, activations, linear, embedding, FusedMoE)",
    on_load="vllm_npu.ops._hooks:on_load",
    on_worker_init="vllm_npu.ops._hooks:on_worker_init",
)

# What vLLM's `vllm.general_plugins` loader calls (entry point `npu_ops`).
load_plugin = COMPONENT.plugin_entry()
