# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The models layer's component declaration. Imports nothing but npu-interface: discovery must stay cheap."""

from vllm_npu.interface import SUPPORTED_VLLM, Component

from ._version import __version__

COMPONENT = Component(
    name="models",
    distribution="npu-models",
    version=__version__,
    interface=">=1.0,<2",
    vllm=SUPPORTED_VLLM,
    summary=(
        "model classes: DeepSeek-V3.2 (DeepseekV32ForCausalLM), Pangu Pro MoE (PanguProMoEForCausalLM); "
        "Qwen2-VL (Qwen2VLForConditionalGeneration), Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration), "
        "Qwen3-VL (Qwen3VLForConditionalGeneration), Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration): NPU "
        "vision attention; Qwen2.5-Omni thinker (Qwen2_5OmniModel, Qwen2_5OmniForConditionalGeneration), Gemma-3 "
        "(Gemma3ForConditionalGeneration), InternVL (InternVLChatModel, InternVLForConditionalGeneration, "
        "InternS1ForConditionalGeneration), MiniCPM-V (MiniCPMV), Qwen2-Audio (Qwen2AudioForConditionalGeneration): "
        "NPU encoder attention; Qwen3-Next (Qwen3NextForCausalLM): gated delta-net hybrid, and its MTP draft "
        "(Qwen3NextMTP)"
    ),
    on_load="vllm_npu.models._hooks:on_load",
)

# What vLLM's `vllm.general_plugins` loader calls (entry point `npu_models`).
load_plugin = COMPONENT.plugin_entry()
