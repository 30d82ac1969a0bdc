# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""RMSNorm overrides: ``npu_rms_norm`` / ``npu_add_rms_norm`` on the NPU, pure-PyTorch twins on the emulated device.

Contracts (torch_npu 2.8.0):

- ``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``: ``x [..., H]`` fp16/bf16/fp32, ``gamma [H]`` same dtype;
  ``y = x * rsqrt(mean(x^2, -1) + eps) * gamma`` computed in fp32 and cast once to ``x.dtype``;
  ``rstd [..., 1]`` fp32.
- ``npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x_sum)`` (documented by its meta registration):
  ``x_sum = x1 + x2`` (fp32 add, cast to the input dtype), ``y = rms_norm(x1 + x2) * gamma``. One kernel launch
  for the residual add and the norm.
- ``npu_gemma_rms_norm(x, gamma, epsilon) -> (y, rstd)``: Gemma's form ``y = norm(x) * (1 + gamma)``.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm_npu.interface import Kernel

# --- kernels --------------------------------------------------------------------------------------------------


def rms_norm_npu(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    import torch_npu

    return torch_npu.npu_rms_norm(x, gamma, eps)


# The reference twins below do the maths in the NPU kernels' order with as few dispatches as it takes: the eps add,
# the rsqrt and the weight product run in place on fresh temporaries (same values, fewer allocations), and the
# upcasts/downcasts are no-ops for fp32 inputs.


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return xf.pow(2).mean(dim=-1, keepdim=True).add_(eps).rsqrt_()


def rms_norm_reference(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    rstd = _rstd(xf, eps)
    return (xf * rstd).mul_(gamma.float()).to(x.dtype), rstd


def add_rms_norm_npu(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch_npu

    return torch_npu.npu_add_rms_norm(x1, x2, gamma, eps)


def add_rms_norm_reference(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = x1.float() + x2.float()
    rstd = _rstd(s, eps)
    return (s * rstd).mul_(gamma.float()).to(x1.dtype), rstd, s.to(x1.dtype)


def gemma_rms_norm_npu(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    import torch_npu

    return torch_npu.npu_gemma_rms_norm(x, gamma, eps)


def gemma_rms_norm_reference(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    rstd = _rstd(xf, eps)
    return (xf * rstd).mul_(1.0 + gamma.float()).to(x.dtype), rstd


RMS_NORM = Kernel("rms_norm", npu=rms_norm_npu, reference=rms_norm_reference)
ADD_RMS_NORM = Kernel("add_rms_norm", npu=add_rms_norm_npu, reference=add_rms_norm_reference)
GEMMA_RMS_NORM = Kernel("gemma_rms_norm", npu=gemma_rms_norm_npu, reference=gemma_rms_norm_reference)


# --- layers ---------------------------------------------------------------------------------------------------


class NPURMSNorm(RMSNorm):
    """vLLM's RMSNorm with the fused kernels. ``forward(x)`` -> y; ``forward(x, residual)`` -> ``(y, x + residual)``
    in one kernel call. Layers the kernels cannot serve (``var_hidden_size`` != hidden size, or no weight) keep
    vLLM's ``forward_native``; the choice is made here, once."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        var_hidden_size: int | None = None,
        has_weight: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden_size, eps, var_hidden_size, has_weight, dtype)
        from .chip_310p import add_rms_norm_kernel  # the chip's pair (310P: unfused add, then npu_rms_norm)

        self._norm = RMS_NORM.select()
        self._add_norm = add_rms_norm_kernel().select()
        if self.variance_size_override is not None or not self.has_weight:
            self._forward_method = self.forward_native

    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # _parameters["weight"] skips nn.Module.__getattr__'s slow path (a measurable part of a decode-size call)
        weight = self._parameters["weight"]
        assert weight is not None  # layers without a weight take forward_native (see __init__)
        if residual is None:
            return self._norm(x, weight, self.variance_epsilon)[0]
        y, _, summed = self._add_norm(x, residual, weight, self.variance_epsilon)
        return y, summed


class NPUGemmaRMSNorm(GemmaRMSNorm):
    """Gemma's RMSNorm (``x * (1 + w)``). With a residual the add runs first (in the input dtype, fp32 for fp16
    inputs as in vLLM), then the Gemma norm kernel: two launches, since torch_npu has no fused add+Gemma norm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self._norm = GEMMA_RMS_NORM.select()

    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x, self.weight, self.variance_epsilon)[0]
        summed = (x.float() + residual.float()).to(x.dtype)
        return self._norm(summed, self.weight, self.variance_epsilon)[0], summed
