# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Per-layer quantization maths of the quantizer: float weights (+ calibration stats) -> msModelSlim tensors.

Each function returns ``{suffix: tensor}`` for one linear layer ``W [N, K]``, with the suffixes msModelSlim writes
(``weight``, ``weight_scale``, ...). They are the exact inverses of the schemes' forward maths (see
``vllm_npu.quant.schemes``); tests use them to build checkpoints.
"""

from __future__ import annotations

import torch

from ..kernels import encode_scale, fp19_truncate, pack_int4_pairs_dim0
from ..schemes.w4a4_flatquant import decompose_dim


def _row_absmax(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8)


def quantize_w8a8_dynamic(w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Symmetric per-channel int8 weights: ``s = max|W_n| / 127``, ``W_q = round(W / s)``."""
    w = w.float()
    s = _row_absmax(w) / 127.0
    q = torch.clamp(torch.round(w / s), -127, 127).to(torch.int8)
    return {"weight": q, "weight_scale": s.to(dtype), "weight_offset": torch.zeros_like(s).to(dtype)}


def activation_qparams(x_min: float, x_max: float) -> tuple[float, int]:
    """Asymmetric per-tensor int8 parameters covering [x_min, x_max] (which always includes 0):
    ``scale = (max - min) / 255``, ``offset = round(-128 - min / scale)``."""
    lo, hi = min(float(x_min), 0.0), max(float(x_max), 0.0)
    scale = max((hi - lo) / 255.0, 1e-8)
    offset = int(max(-128, min(127, round(-128 - lo / scale))))
    return scale, offset


def quantize_w8a8(
    w: torch.Tensor, bias: torch.Tensor | None, x_min: float, x_max: float, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Static W8A8: symmetric per-channel int8 weights, asymmetric per-tensor int8 input (from calibration).

    ``deq_scale = s_x * s_w`` (int64 FP19 form for fp16 models, float32 otherwise);
    ``quant_bias = round(bias / deq_scale) − o_x · Σ_k W_q``.
    """
    wq = quantize_w8a8_dynamic(w, dtype)
    s_w = wq["weight_scale"].float().reshape(-1)
    s_x, o_x = activation_qparams(x_min, x_max)
    s_x = float(torch.tensor(s_x, dtype=dtype).float())  # what the checkpoint (params_dtype) can hold
    deq = (s_x * s_w).float()
    if dtype == torch.float16:
        deq = fp19_truncate(deq)
    qbias = -o_x * wq["weight"].to(torch.int64).sum(dim=1)
    if bias is not None:
        qbias = qbias + torch.round(bias.float() / deq).to(torch.int64)
    if dtype == torch.float16:
        deq_disk = encode_scale(deq)
    else:
        deq_disk = deq
    return {
        **wq,
        "input_scale": torch.tensor([s_x], dtype=dtype),
        "input_offset": torch.tensor([o_x], dtype=dtype),
        "deq_scale": deq_disk,
        "quant_bias": qbias.to(torch.int32),
    }


def quantize_w4a8(
    w: torch.Tensor, group_size: int, version: str, row_parallel: bool, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Two-level int4: per-channel int8 (``s1 = max|W_n| / 127``), then per-group int4 of the int8 values
    (``s2[n, g] = max|W8[n, group g]| / 7``); ``W ≈ W4 * s1 * s2``. ``group_size`` 0 = per-channel int4."""
    w = w.float()
    n, k = w.shape
    s1 = _row_absmax(w) / 127.0
    w8 = torch.round(w / s1)
    out: dict[str, torch.Tensor] = {"weight_scale": s1.to(dtype), "weight_offset": torch.zeros_like(s1).to(dtype)}
    if group_size:
        g = w8.reshape(n, k // group_size, group_size)
        s2 = (g.abs().amax(dim=-1) / 7.0).clamp_min(1e-8)  # [N, G]
        w4 = torch.clamp(torch.round(g / s2.unsqueeze(-1)), -8, 7).reshape(n, k)
        out["weight_scale_second"] = s2.to(dtype)
        out["weight_offset_second"] = torch.zeros_like(s2).to(dtype)
    else:
        s = _row_absmax(w8) / 7.0
        w4 = torch.clamp(torch.round(w8 / s), -8, 7)
        out["weight_scale"] = (s1 * s).to(dtype)
    w4 = w4.to(torch.int8)
    if version == "1.0.0":
        out["weight"] = pack_int4_pairs_dim0(w4)
        # the int8 x int4 expert kernel's bias, 8 * sum_k W4 * scale (what vllm-ascend computes for version 0), as
        # partial sums over 16 chunks of K for row-parallel layers (so tensor-parallel ranks dividing 16 each get
        # theirs) and the whole sum otherwise; the dense W4A8 path (weight-only) does not read it
        scale = out["weight_scale"].float()
        if group_size:
            scale = scale * out["weight_scale_second"].float().repeat_interleave(group_size, dim=1)
        terms = 8 * w4.float() * scale  # [N, K]
        chunks = terms.tensor_split(16 if row_parallel else 1, dim=1)
        out["scale_bias"] = torch.stack([c.sum(1) for c in chunks], dim=1).to(torch.float32)
    else:
        out["weight"] = w4
    return out


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A random orthogonal ``[n, n]`` matrix (QR of a Gaussian, sign-fixed), deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(r))).float()


def flatquant_transforms(k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(left [L, L], right [R, R]) orthogonal transforms for input size ``k`` (``L * R = k``)."""
    left, right = decompose_dim(k)
    return random_orthogonal(left, seed * 7919 + left), random_orthogonal(right, seed * 7919 + right + 1)


def quantize_w4a4_flatquant(
    w: torch.Tensor, left: torch.Tensor, right: torch.Tensor, clip_ratio: float, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """FlatQuant with orthogonal transforms P = left ⊗ right: ``W' = W P`` (= ``W P⁻ᵀ``), i.e.
    ``W'_n = leftᵀ · W_n · right`` with ``W_n`` viewed as ``[L, R]``; then symmetric per-channel int4."""
    w = w.float()
    n, k = w.shape
    nl, nr = left.shape[0], right.shape[0]
    left_d, right_d = left.to(dtype).float(), right.to(dtype).float()  # the transforms as stored
    wt = (left_d.t() @ w.reshape(n, nl, nr) @ right_d).reshape(n, k)
    s = _row_absmax(wt) / 7.0
    q = torch.clamp(torch.round(wt / s), -8, 7).to(torch.int8)
    return {
        "weight": q,
        "weight_scale": s.float(),
        "weight_offset": torch.zeros_like(s).float(),
        "left_trans": left.to(dtype),
        "right_trans": right.to(dtype),
        "clip_ratio": torch.tensor([clip_ratio], dtype=torch.float32),
    }
