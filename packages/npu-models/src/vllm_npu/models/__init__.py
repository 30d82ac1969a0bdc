# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.models: the public API of the models layer.

Importing this package is cheap (exports load on first access): vLLM imports it in every process when it
discovers plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

# Lazy exports (PEP 562): name -> ".module:attr", imported on first access. The TYPE_CHECKING block and
# __all__ mirror the table for type checkers and IDEs; tests/test_doors.py checks that the three agree.
_EXPORTS: dict[str, str] = {
    "MODEL_CONFIGS": "._hooks:MODEL_CONFIGS",
    "MODEL_OVERRIDES": "._hooks:MODEL_OVERRIDES",
    "register_configs": "._hooks:register_configs",
    "register_models": "._hooks:register_models",
    "AscendMultiHeadAttention": ".encoder_attention:AscendMultiHeadAttention",
    "adopt_encoder_attention": ".encoder_attention:adopt_encoder_attention",
    "npu_encoder_attention": ".encoder_attention:npu_encoder_attention",
    "AscendGemma3ForConditionalGeneration": ".multimodal:AscendGemma3ForConditionalGeneration",
    "AscendInternS1ForConditionalGeneration": ".multimodal:AscendInternS1ForConditionalGeneration",
    "AscendInternVLChatModel": ".multimodal:AscendInternVLChatModel",
    "AscendMiniCPMV": ".multimodal:AscendMiniCPMV",
    "AscendQwen2AudioForConditionalGeneration": ".multimodal:AscendQwen2AudioForConditionalGeneration",
    "AscendQwen2_5OmniThinkerForConditionalGeneration": ".multimodal:AscendQwen2_5OmniThinkerForConditionalGeneration",
    "AscendDeepseekV32ForCausalLM": ".deepseek_v32:AscendDeepseekV32ForCausalLM",
    "AscendIndexer": ".deepseek_v32:AscendIndexer",
    "AscendIndexerKeyCache": ".deepseek_v32:AscendIndexerKeyCache",
    "PanguProMoEConfig": ".pangu_config:PanguProMoEConfig",
    "AscendPanguProMoEForCausalLM": ".pangu_moe:AscendPanguProMoEForCausalLM",
    "moge_select_experts": ".pangu_moe:moge_select_experts",
    "AscendQwen2VLForConditionalGeneration": ".qwen_vl:AscendQwen2VLForConditionalGeneration",
    "AscendQwen2_5_VLForConditionalGeneration": ".qwen_vl:AscendQwen2_5_VLForConditionalGeneration",
    "AscendQwen3VLForConditionalGeneration": ".qwen_vl:AscendQwen3VLForConditionalGeneration",
    "AscendQwen3VLMoeForConditionalGeneration": ".qwen_vl:AscendQwen3VLMoeForConditionalGeneration",
    "AscendQwen2VisionAttention": ".vision:AscendQwen2VisionAttention",
    "AscendQwen2_5_VisionAttention": ".vision:AscendQwen2_5_VisionAttention",
    "adopt_vision_attention": ".vision:adopt_vision_attention",
    "pad_vision_heads": ".vision:pad_vision_heads",
    "NPUQwen3NextForCausalLM": ".qwen3_next:NPUQwen3NextForCausalLM",
    "NPUQwen3NextMTP": ".qwen3_next_mtp:NPUQwen3NextMTP",
    "selftest_cases": ".selftest:selftest_cases",
}

if TYPE_CHECKING:
    from ._hooks import MODEL_CONFIGS, MODEL_OVERRIDES, register_configs, register_models
    from .deepseek_v32 import AscendDeepseekV32ForCausalLM, AscendIndexer, AscendIndexerKeyCache
    from .encoder_attention import AscendMultiHeadAttention, adopt_encoder_attention, npu_encoder_attention
    from .multimodal import (
        AscendGemma3ForConditionalGeneration,
        AscendInternS1ForConditionalGeneration,
        AscendInternVLChatModel,
        AscendMiniCPMV,
        AscendQwen2_5OmniThinkerForConditionalGeneration,
        AscendQwen2AudioForConditionalGeneration,
    )
    from .pangu_config import PanguProMoEConfig
    from .pangu_moe import AscendPanguProMoEForCausalLM, moge_select_experts
    from .qwen3_next import NPUQwen3NextForCausalLM
    from .qwen3_next_mtp import NPUQwen3NextMTP
    from .qwen_vl import (
        AscendQwen2_5_VLForConditionalGeneration,
        AscendQwen2VLForConditionalGeneration,
        AscendQwen3VLForConditionalGeneration,
        AscendQwen3VLMoeForConditionalGeneration,
    )
    from .selftest import selftest_cases
    from .vision import (
        AscendQwen2_5_VisionAttention,
        AscendQwen2VisionAttention,
        adopt_vision_attention,
        pad_vision_heads,
    )
else:
    from vllm_npu.interface import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "MODEL_CONFIGS",
    "MODEL_OVERRIDES",
    "AscendDeepseekV32ForCausalLM",
    "AscendGemma3ForConditionalGeneration",
    "AscendIndexer",
    "AscendIndexerKeyCache",
    "AscendInternS1ForConditionalGeneration",
    "AscendInternVLChatModel",
    "AscendMiniCPMV",
    "AscendMultiHeadAttention",
    "AscendPanguProMoEForCausalLM",
    "AscendQwen2AudioForConditionalGeneration",
    "AscendQwen2VLForConditionalGeneration",
    "AscendQwen2VisionAttention",
    "AscendQwen2_5OmniThinkerForConditionalGeneration",
    "AscendQwen2_5_VLForConditionalGeneration",
    "AscendQwen2_5_VisionAttention",
    "AscendQwen3VLForConditionalGeneration",
    "AscendQwen3VLMoeForConditionalGeneration",
    "NPUQwen3NextForCausalLM",
    "NPUQwen3NextMTP",
    "PanguProMoEConfig",
    "__version__",
    "adopt_encoder_attention",
    "adopt_vision_attention",
    "moge_select_experts",
    "npu_encoder_attention",
    "pad_vision_heads",
    "register_configs",
    "register_models",
    "selftest_cases",
]
