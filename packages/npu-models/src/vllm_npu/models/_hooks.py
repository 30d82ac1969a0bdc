# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Hooks of the models component: register our model classes with vLLM's ``ModelRegistry`` and the configs of model
types transformers does not know with its ``AutoConfig``.

The load hook runs only where our platform is active (``registry.load_component`` checks that), in every process
that loads vLLM's general plugins; the worker init runs it again (once per process). Registration uses vLLM's lazy
``"module:Class"`` form, so nothing model-related is imported until vLLM builds that architecture (the entry is
ours, :mod:`._registry_entry`, so vLLM's inspection of the class is cached); a config class is
imported when its model type is registered (it needs only transformers, which vLLM has imported by then).
"""

from __future__ import annotations

from vllm_npu.interface import HookContext, get_logger, once

logger = get_logger(__name__)

#: HF architecture name -> ``"module:Class"`` of our model class for it (an override, or one vLLM lacks).
MODEL_OVERRIDES: dict[str, str] = {
    # vLLM 0.11 maps this architecture to DeepseekV3ForCausalLM, whose sparse (V3.2) path is CUDA-only.
    "DeepseekV32ForCausalLM": "vllm_npu.models.deepseek_v32:AscendDeepseekV32ForCausalLM",
    # vLLM 0.11's module imports its FLA Triton kernels at import (fails without a working Triton); ours does not.
    "Qwen3NextForCausalLM": "vllm_npu.models.qwen3_next:NPUQwen3NextForCausalLM",
    # Its MTP draft (speculative method qwen3_next_mtp): vLLM's module imports qwen3_next, so it fails the same way.
    "Qwen3NextMTP": "vllm_npu.models.qwen3_next_mtp:NPUQwen3NextMTP",
    # Not in vLLM 0.11 at all.
    "PanguProMoEForCausalLM": "vllm_npu.models.pangu_moe:AscendPanguProMoEForCausalLM",
    # The Qwen VL family: vLLM's classes with the vision attention on the NPU kernels (vllm_npu.models.vision).
    "Qwen2VLForConditionalGeneration": "vllm_npu.models.qwen_vl:AscendQwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "vllm_npu.models.qwen_vl:AscendQwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "vllm_npu.models.qwen_vl:AscendQwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration": "vllm_npu.models.qwen_vl:AscendQwen3VLMoeForConditionalGeneration",
    # Multimodal families beyond Qwen-VL: vLLM's classes with their encoders on the NPU kernel
    # (vllm_npu.models.multimodal, through the shared seam vllm_npu.models.encoder_attention).
    "Gemma3ForConditionalGeneration": "vllm_npu.models.multimodal:AscendGemma3ForConditionalGeneration",
    "InternVLChatModel": "vllm_npu.models.multimodal:AscendInternVLChatModel",
    "InternVLForConditionalGeneration": "vllm_npu.models.multimodal:AscendInternS1ForConditionalGeneration",
    "InternS1ForConditionalGeneration": "vllm_npu.models.multimodal:AscendInternS1ForConditionalGeneration",
    "MiniCPMV": "vllm_npu.models.multimodal:AscendMiniCPMV",
    "Qwen2AudioForConditionalGeneration": "vllm_npu.models.multimodal:AscendQwen2AudioForConditionalGeneration",
    "Qwen2_5OmniModel": "vllm_npu.models.multimodal:AscendQwen2_5OmniThinkerForConditionalGeneration",
    "Qwen2_5OmniForConditionalGeneration": "vllm_npu.models.multimodal:AscendQwen2_5OmniThinkerForConditionalGeneration",
}

#: HF ``model_type`` -> ``"module:Class"`` of its ``PretrainedConfig``, for model types transformers (< 5) lacks.
MODEL_CONFIGS: dict[str, str] = {
    "PanguProMoE": "vllm_npu.models.pangu_config:PanguProMoEConfig",
}


def register_models() -> list[str]:
    """Register :data:`MODEL_OVERRIDES` with ``vllm.ModelRegistry`` once per process; returns the archs registered
    now. Idempotent: a second call (or a second process hook) registers nothing."""
    from vllm import ModelRegistry

    from ._registry_entry import registry_entry

    done = []
    for arch, target in MODEL_OVERRIDES.items():

        def _register(arch: str = arch, target: str = target) -> None:
            ModelRegistry.register_model(arch, target)  # vLLM's checks of the arch and "module:Class"
            # ... then our entry in its place: the same lazy import, the inspection cached on our sources.
            ModelRegistry.models[arch] = registry_entry(target)
            logger.debug("model override %s -> %s", arch, target)

        if once(f"vllm_npu.models.register_model:{arch}", _register):
            done.append(arch)
    return done


def register_configs() -> list[str]:
    """Register :data:`MODEL_CONFIGS` with transformers' ``AutoConfig`` once per process (so a local checkpoint's
    ``config.json`` with that ``model_type`` loads without remote code); returns the model types registered now. A
    model type transformers already maps is left as it is."""
    import importlib

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    done = []
    for model_type, target in MODEL_CONFIGS.items():
        # transformers' own mapping is the idempotence guard: a second call finds the type there.
        if model_type in CONFIG_MAPPING:
            continue
        module, _, name = target.partition(":")
        AutoConfig.register(model_type, getattr(importlib.import_module(module), name))
        logger.debug("config %s -> %s", model_type, target)
        done.append(model_type)
    return done


def on_load(ctx: HookContext) -> None:
    register_configs()
    register_models()
