# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The gated delta-net's element-wise pieces: the gated RMS norm of the core output and the decay / write gates.

Gated RMS norm (Qwen3-Next's ``RMSNormGated``, norm before gate)::

    y = weight * x / sqrt(mean(x ** 2) + eps) * silu(z)          over the last dim (one value head)

Gating (vLLM's ``fused_gdn_gating``): ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32 log decay, softplus with
beta 1 and threshold 20), ``beta = sigmoid(b)``.

NPU path (what vllm-ascend v0.11.0 runs on hardware): both are Triton kernels compiled by Triton-Ascend — vLLM's FLA
``rmsnorm_fn`` (vllm-ascend swaps in its own ``LayerNormFn`` body) and vLLM's ``fused_gdn_gating`` from
``vllm.model_executor.models.qwen3_next`` (imported only on that path: its module imports the FLA kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm_npu.interface import Kernel

from ._triton_ascend import require_triton_ascend


def rms_norm_gated_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z ``[M, N]``; weight ``[N]``; returns ``[M, N]`` in x's dtype (fp32 inside, as HF's
    ``Qwen3NextRMSNormGated`` rounds: the normalised x is cast to x's dtype before the weight and gate)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)


def rms_norm_gated_npu(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """NPU path of :func:`rms_norm_gated_ref`: vLLM's FLA ``rmsnorm_fn`` (group = N, norm before gate)."""
    require_triton_ascend("rms_norm_gated")
    from vllm.model_executor.layers.fla.ops.layernorm_guard import rmsnorm_fn

    out: torch.Tensor = rmsnorm_fn(x, weight, None, z=z, eps=eps, group_size=None, norm_before_gate=True)
    return out


def gdn_gating_ref(
    a_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b ``[T, HV]``; A_log, dt_bias ``[HV]``; returns (g fp32 ``[T, HV]``, beta ``[T, HV]`` in b's dtype)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    return g, b.sigmoid()


def gdn_gating_npu(
    a_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NPU path of :func:`gdn_gating_ref`: vLLM's Triton ``fused_gdn_gating`` and ``b.sigmoid()``, as vllm-ascend
    v0.11.0's ``CustomQwen3NextGatedDeltaNet._forward`` computes them."""
    require_triton_ascend("fused_gdn_gating")
    from vllm.model_executor.models.qwen3_next import fused_gdn_gating

    g: torch.Tensor = fused_gdn_gating(a_log, a, dt_bias)
    return g, b.sigmoid()


RMS_NORM_GATED = Kernel("gdn_rms_norm_gated", rms_norm_gated_npu, rms_norm_gated_ref)
GDN_GATING = Kernel("gdn_gating", gdn_gating_npu, gdn_gating_ref)
