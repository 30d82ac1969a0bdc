# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.ops.lora: multi-LoRA on the NPU (vLLM's ``get_punica_wrapper`` target and the LoRA layer classes).

Lazy exports: importing this package imports neither torch nor vLLM.
"""

from vllm_npu.interface.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PunicaWrapperNPU": ".punica:PunicaWrapperNPU",
    "NPU_LORA_CLASSES": ".layers:NPU_LORA_CLASSES",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
