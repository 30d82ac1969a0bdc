# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Patch ``repetition-penalty-torch``: vLLM's repetition penalty must never reach its CUDA-only ``_C`` kernel.

vLLM 0.11.0 (``vllm/_custom_ops.py::apply_repetition_penalties``) picks its kernel with
``if logits.is_cuda and logits.is_contiguous()`` and then calls ``torch.ops._C.apply_repetition_penalties_``.
On an Ascend host vLLM is built with ``VLLM_TARGET_DEVICE=empty`` (no ``vllm._C``), and torch_npu 2.8.0 rebinds
``torch.Tensor.is_cuda`` to ``torch.Tensor.is_npu`` whenever ``torch_npu.contrib.transfer_to_npu`` is imported or
``TORCH_NPU_SANITIZER`` is set (``torch_npu/contrib/transfer_to_npu.py``, ``torch_npu/npu/_stream_check.py``). Then
every NPU logits tensor claims to be CUDA, and the first request with ``repetition_penalty != 1`` kills the engine
with ``AttributeError: '_OpNamespace' '_C' object has no attribute 'apply_repetition_penalties_'``.

The replacement always runs vLLM's own torch implementation (``apply_repetition_penalties_torch``), which is correct
on every device. ``vllm.model_executor.layers.utils.apply_penalties`` imports the function from
``vllm._custom_ops`` at call time, so rebinding the module attribute reaches the sampler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def make_replacement(original: Callable[..., None]) -> Callable[..., None]:
    """Build the device-agnostic ``apply_repetition_penalties`` (``original`` is kept by the registry)."""
    from vllm._custom_ops import apply_repetition_penalties_torch

    def apply_repetition_penalties(logits: Any, prompt_mask: Any, output_mask: Any, repetition_penalties: Any) -> None:
        """In place on ``logits`` [num_seqs, vocab]: tokens seen in the prompt or output (bool masks, same shape)
        get positive logits divided and negative logits multiplied by ``repetition_penalties`` [num_seqs]."""
        apply_repetition_penalties_torch(logits, prompt_mask, output_mask, repetition_penalties)

    apply_repetition_penalties.__module__ = original.__module__
    apply_repetition_penalties.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_repetition_penalties
