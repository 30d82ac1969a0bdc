# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The kv layer's component declaration. Imports nothing but npu-interface: discovery must stay cheap."""

from vllm_npu.interface import SUPPORTED_VLLM, Component

from ._version import __version__

COMPONENT = Component(
    name="kv",
    distribution="npu-kv",
    version=__version__,
    interface=">=1.0,<2",
    vllm=SUPPORTED_VLLM,
    summary="prefill-decode disaggregation: the Mooncake KV connector and vllm-npu pd-proxy",
    on_load="vllm_npu.kv._hooks:on_load",
    plugin="npu_kv_connector",
)

# What vLLM's `vllm.general_plugins` loader calls (entry point `npu_kv_connector`).
load_plugin = COMPONENT.plugin_entry()
