# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The op kernels that differ on an Ascend 310P (Atlas 300I), as vllm-ascend v0.11.0 runs them there.

- ``swiglu_310p`` (``SiluAndMul`` and the MoE expert MLP's activation): ``npu_swiglu`` on a float32 copy, cast back
  to the input dtype (vllm-ascend ``ops/activation.py:39-40``, ``ops/moe/moe_mlp.py:211-213``; their float16 is the
  310P model dtype). The reference twin is :func:`.swiglu.swiglu_reference`, which already computes in float32 and
  casts once.
- ``add_rms_norm_310p`` (``RMSNorm`` with a residual): no fused ``npu_add_rms_norm`` on the 310P: the residual add in
  the input dtype (one rounding), then ``npu_rms_norm`` of that sum (vllm-ascend ``ops/layernorm.py:70-75``). Same
  contract as :data:`.layernorm.ADD_RMS_NORM` (``(y, rstd, x1 + x2)``); its twin rounds the sum to the input dtype
  before the norm, as the unfused NPU sequence does (the A2/A3 twin keeps it in float32).

Not different here: rotary embedding (the plugin calls ``npu_rotary_mul`` on every chip; vllm-ascend's 310P change is
to skip its own AscendC kernel, which the plugin does not have), the sampler (the plugin never calls
``npu_top_k_top_p``, which vllm-ascend skips on 310P), Gemma's norm (already an unfused add + ``npu_gemma_rms_norm``).
"""

from __future__ import annotations

import torch
from vllm_npu.interface import Kernel, is_310p

from .layernorm import ADD_RMS_NORM, rms_norm_reference
from .swiglu import SWIGLU, _odd_width, swiglu_reference


def swiglu_310p_npu(x: torch.Tensor) -> torch.Tensor:
    import torch_npu

    if x.shape[-1] % 2:
        raise _odd_width(x)
    return torch_npu.npu_swiglu(x.float(), -1).to(x.dtype)


SWIGLU_310P = Kernel("swiglu_310p", npu=swiglu_310p_npu, reference=swiglu_reference)


def add_rms_norm_310p_npu(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch_npu

    summed = x1 + x2.to(x1.dtype)
    y, rstd = torch_npu.npu_rms_norm(summed, gamma, eps)
    return y, rstd, summed


def add_rms_norm_310p_reference(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    summed = x1 + x2.to(x1.dtype)
    y, rstd = rms_norm_reference(summed, gamma, eps)
    return y, rstd, summed


ADD_RMS_NORM_310P = Kernel("add_rms_norm_310p", npu=add_rms_norm_310p_npu, reference=add_rms_norm_310p_reference)


def swiglu_kernel() -> Kernel:
    """``SiluAndMul``'s kernel pair on this process's chip."""
    return SWIGLU_310P if is_310p() else SWIGLU


def add_rms_norm_kernel() -> Kernel:
    """``RMSNorm``-with-residual's kernel pair on this process's chip."""
    return ADD_RMS_NORM_310P if is_310p() else ADD_RMS_NORM
