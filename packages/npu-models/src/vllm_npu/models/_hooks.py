# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Hooks of the models component: register our model overrides with vLLM's ``ModelRegistry``.

The load hook runs only where our platform is active (``registry.load_component`` checks that), in every process
that loads vLLM's general plugins; the worker init runs it again (once per process). Registration uses vLLM's lazy
``"module:Class"`` form, so nothing model-related is imported until vLLM builds that architecture.
"""

from __future__ import annotations

from vllm_npu.interface.component import HookContext
from vllm_npu.interface.log import get_logger
from vllm_npu.interface.registry import once

logger = get_logger(__name__)

#: HF architecture name -> ``"module:Class"`` of our override.
MODEL_OVERRIDES: dict[str, str] = {
    # vLLM 0.11 maps this architecture to DeepseekV3ForCausalLM, whose sparse (V3.2) path is CUDA-only.
    "DeepseekV32ForCausalLM": "vllm_npu.models.deepseek_v32:AscendDeepseekV32ForCausalLM",
    # The Qwen VL family: vLLM's classes with the vision attention on the NPU kernels (vllm_npu.models.vision).
    "Qwen2VLForConditionalGeneration": "vllm_npu.models.qwen_vl:AscendQwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "vllm_npu.models.qwen_vl:AscendQwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "vllm_npu.models.qwen_vl:AscendQwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration": "vllm_npu.models.qwen_vl:AscendQwen3VLMoeForConditionalGeneration",
}


def register_models() -> list[str]:
    """Register :data:`MODEL_OVERRIDES` with ``vllm.ModelRegistry`` once per process; returns the archs registered
    now. Idempotent: a second call (or a second process hook) registers nothing."""
    from vllm import ModelRegistry

    done = []
    for arch, target in MODEL_OVERRIDES.items():

        def _register(arch: str = arch, target: str = target) -> None:
            ModelRegistry.register_model(arch, target)
            logger.debug("model override %s -> %s", arch, target)

        if once(f"vllm_npu.models.register_model:{arch}", _register):
            done.append(arch)
    return done


def on_load(ctx: HookContext) -> None:
    register_models()
