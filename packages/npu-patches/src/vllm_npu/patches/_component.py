# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The patches layer's component declaration. Imports nothing but npu-interface: discovery must stay cheap."""

from vllm_npu.interface import SUPPORTED_VLLM, Component

from ._version import __version__

COMPONENT = Component(
    name="patches",
    distribution="npu-patches",
    version=__version__,
    interface=">=1.0,<2",
    vllm=SUPPORTED_VLLM,
    summary="the monkey-patch sets vLLM still needs, with vLLM ranges and removal plans",
    on_load="vllm_npu.patches._hooks:on_load",
    on_worker_init="vllm_npu.patches._hooks:on_worker_init",
)

# What vLLM's `vllm.general_plugins` loader calls (entry point `npu_patches`).
load_plugin = COMPONENT.plugin_entry()
