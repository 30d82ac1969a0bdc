# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Activation overrides: ``npu_swiglu`` for SiluAndMul, ``npu_fast_gelu`` for QuickGELU.

Contracts (torch_npu 2.8.0 docs):

- ``npu_swiglu(x, dim=-1) -> y``: ``silu(x[..., :d]) * x[..., d:]`` (vLLM's SiluAndMul); its twins live in
  :mod:`.swiglu`, shared with the MoE experts.
- ``npu_fast_gelu(x) -> y``: on Atlas A2/A3 ``y = x / (1 + exp(-1.702 x))`` = ``x * sigmoid(1.702 x)``
  (QuickGELU). Same shape and dtype.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.activation import QuickGELU, SiluAndMul
from vllm_npu.interface import Kernel

from .swiglu import SWIGLU, swiglu_npu, swiglu_reference  # noqa: F401 (the SiluAndMul kernel twins, re-exported)


def fast_gelu_npu(x: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_fast_gelu(x)


def fast_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.sigmoid(1.702 * xf)).to(x.dtype)


FAST_GELU = Kernel("fast_gelu", npu=fast_gelu_npu, reference=fast_gelu_reference)


class NPUSiluAndMul(SiluAndMul):
    """``x [..., 2d] -> silu(x[..., :d]) * x[..., d:]`` in one kernel."""

    def __init__(self) -> None:
        super().__init__()
        from .chip_310p import swiglu_kernel  # the chip's pair (310P: npu_swiglu in float32)

        self._kernel = swiglu_kernel().select()

    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x)  # the kernel rejects an odd last dimension


class NPUQuickGELU(QuickGELU):
    """``x * sigmoid(1.702 x)`` in one kernel."""

    def __init__(self) -> None:
        super().__init__()
        self._kernel = FAST_GELU.select()

    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x)
