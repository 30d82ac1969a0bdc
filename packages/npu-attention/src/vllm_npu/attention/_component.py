# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The attention layer's component declaration. Imports nothing but npu-interface: discovery must stay cheap."""

from vllm_npu.interface import SUPPORTED_VLLM, Component

from ._version import __version__

COMPONENT = Component(
    name="attention",
    distribution="npu-attention",
    version=__version__,
    interface=">=1.0,<2",
    vllm=SUPPORTED_VLLM,
    summary="attention backends (Ascend GQA, MLA, SFA), metadata builders, masks, KV-cache ops",
    on_load="vllm_npu.attention._hooks:on_load",
)

# What vLLM's `vllm.general_plugins` loader calls (entry point `npu_attention`).
load_plugin = COMPONENT.plugin_entry()
