# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.ops.lora: multi-LoRA on the NPU (vLLM's ``get_punica_wrapper`` target, the LoRA layer
classes, and the worker LoRA manager that checks adapter shapes).

Lazy exports: importing this package imports neither torch nor vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Lazy exports (PEP 562): name -> ".module:attr", imported on first access. The TYPE_CHECKING block and
# __all__ mirror the table for type checkers and IDEs; tests/test_doors.py checks that the three agree.
_EXPORTS: dict[str, str] = {
    "PunicaWrapperNPU": ".punica:PunicaWrapperNPU",
    "NPU_LORA_CLASSES": ".layers:NPU_LORA_CLASSES",
    "NPUWorkerLoRAManager": ".manager:NPUWorkerLoRAManager",
}

if TYPE_CHECKING:
    from .layers import NPU_LORA_CLASSES
    from .manager import NPUWorkerLoRAManager
    from .punica import PunicaWrapperNPU
else:
    from vllm_npu.interface import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "NPU_LORA_CLASSES",
    "NPUWorkerLoRAManager",
    "PunicaWrapperNPU",
]
