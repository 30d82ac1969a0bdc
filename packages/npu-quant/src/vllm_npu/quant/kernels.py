# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Quantization kernels: each torch_npu call beside its pure-PyTorch reference twin (same shapes, dtypes, layouts).

Schemes pick a kernel once, when their layer is built (:meth:`vllm_npu.interface.Kernel.select`). The reference
twins are the semantics stated in torch_npu 2.8.0's op docs; where the docs leave something open, the assumption is
written next to the twin and the NPU path is the arbiter.

Layout conventions shared by both twins:

- int4 data travels as int32, 8 values per int32 along the last dimension; value ``j`` of a group of 8 sits in
  bits ``4j..4j+3`` (two's complement nibble). ASSUMPTION: this is the order ``npu_convert_weight_to_int4pack`` and
  ``npu_kronecker_quant`` produce (the docs only say "8 int4 per int32, interleaved"); the reference twins use it
  consistently, so reference results do not depend on it. The ``version: 1.0.0`` W4A8 checkpoint packs two int4 per
  int8 along the output dim with the even index in the low nibble, which is the same order once viewed as int32.
- An int64 dequant scale is the ``npu_trans_quant_param`` form: float32 bits, mantissa truncated to FP19 (10 bits),
  in the low 32 bits.
"""

from __future__ import annotations

import torch
from vllm_npu.interface import Kernel, KernelContractError

# --------------------------------------------------------------------------------------------------------------
# int4 packing helpers (pure torch; used by the reference twins and by the quantizer)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack integer ``values`` in [-8, 7] (any int dtype, last dim divisible by 8) into int32 ``[..., C/8]``."""
    if values.shape[-1] % 8:
        raise KernelContractError(f"int4 packing needs the last dim divisible by 8, got shape {tuple(values.shape)}")
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < -8 or int(v.max()) > 7):
        raise KernelContractError(f"int4 values must lie in [-8, 7], got [{int(v.min())}, {int(v.max())}]")
    nib = (v & 0xF).reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=v.device)
    word = (nib << shifts).sum(-1)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 ``[..., C/8]`` -> int8 ``[..., C]`` in [-8, 7]."""
    if packed.dtype != torch.int32:
        raise KernelContractError(f"packed int4 data must be int32, got {packed.dtype}")
    # Byte-wise (little-endian int32: byte i holds values 2i (low nibble) and 2i+1 (high nibble)).
    b = packed.contiguous().view(torch.uint8)
    nib = torch.stack([b & 0xF, b >> 4], dim=-1).to(torch.int8)
    nib = torch.where(nib >= 8, nib - 16, nib)
    return nib.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def pack_int4_pairs_dim0(values: torch.Tensor) -> torch.Tensor:
    """The W4A8 ``version: 1.0.0`` disk form: int4 ``[N, K]`` -> int8 ``[N/2, K]``, row ``2i`` in the low nibble."""
    if values.shape[0] % 2:
        raise KernelContractError(f"pairwise int4 packing needs an even first dim, got {tuple(values.shape)}")
    v = values.to(torch.int16)
    low, high = v[0::2] & 0xF, v[1::2] & 0xF
    byte = low | (high << 4)
    return torch.where(byte >= 128, byte - 256, byte).to(torch.int8)


def unpack_int4_pairs_dim0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_pairs_dim0`: int8 ``[N/2, K]`` -> int8 ``[N, K]``."""
    b = packed.to(torch.int16) & 0xFF
    low, high = b & 0xF, (b >> 4) & 0xF
    low = torch.where(low >= 8, low - 16, low)
    high = torch.where(high >= 8, high - 16, high)
    return torch.stack([low, high], dim=1).reshape(packed.shape[0] * 2, *packed.shape[1:]).to(torch.int8)


def fp19_truncate(scale: torch.Tensor) -> torch.Tensor:
    """float32 -> float32 with the mantissa truncated to 10 bits (what ``npu_trans_quant_param`` round_mode=0 keeps)."""
    bits = scale.to(torch.float32).contiguous().view(torch.int32)
    return (bits & ~0x1FFF).view(torch.float32)


def encode_scale(scale: torch.Tensor) -> torch.Tensor:
    """float ``[N]`` -> int64 ``[N]`` holding its float32 bits in the low 32 bits (as is: no FP19 truncation);
    :func:`decode_scale` inverts it."""
    return scale.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def decode_scale(scale: torch.Tensor) -> torch.Tensor:
    """A dequant scale as float32: int64 (``npu_trans_quant_param`` form) is decoded, floats are cast."""
    if scale.dtype == torch.int64:
        low = (scale & 0xFFFFFFFF).to(torch.int64)
        low = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32)
        return low.view(torch.float32)
    return scale.to(torch.float32)


# --------------------------------------------------------------------------------------------------------------
# npu_trans_quant_param


def _trans_quant_param_npu(scale: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_trans_quant_param(scale.to(torch.float32))


def _trans_quant_param_ref(scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[N]`` -> int64 ``[N]`` holding the FP19-truncated float32 bits in the low 32 bits."""
    return encode_scale(fp19_truncate(scale))


trans_quant_param = Kernel("trans_quant_param", npu=_trans_quant_param_npu, reference=_trans_quant_param_ref)


# --------------------------------------------------------------------------------------------------------------
# npu_format_cast to FRACTAL_NZ (Ascend 310P int8 weights)


def _weight_to_nz_npu(weight: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_format_cast(weight, 29)  # ACL_FORMAT_FRACTAL_NZ


def _weight_to_nz_ref(weight: torch.Tensor) -> torch.Tensor:
    """The same logical tensor: FRACTAL_NZ is a storage format of the NPU tensor; shape, indexing and every op's
    result are those of the ND tensor (torch_npu converts inside the kernels), so the twin is the identity."""
    return weight


weight_to_nz = Kernel("weight_to_nz", npu=_weight_to_nz_npu, reference=_weight_to_nz_ref)


# --------------------------------------------------------------------------------------------------------------
# npu_quantize (static per-tensor activation quant, multiply mode)


def _quantize_npu(x: torch.Tensor, inv_scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_quantize(x, inv_scale, offset, torch.qint8, -1, False)


def _quantize_ref(x: torch.Tensor, inv_scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``int8(clamp(round(x * inv_scale + offset), -128, 127))``; ``inv_scale``/``offset`` are ``[K]`` in x's dtype.

    The docs do not state the rounding mode; the reference rounds half to even (torch.round).
    """
    if inv_scale.shape[-1] != x.shape[-1] or offset.shape[-1] != x.shape[-1]:
        raise KernelContractError(
            f"npu_quantize: scales {tuple(inv_scale.shape)} / offsets {tuple(offset.shape)} must match x's last dim "
            f"{x.shape[-1]}"
        )
    y = x.to(torch.float32) * inv_scale.to(torch.float32) + offset.to(torch.float32)
    return torch.clamp(torch.round(y), -128, 127).to(torch.int8)


quantize_per_tensor = Kernel("npu_quantize", npu=_quantize_npu, reference=_quantize_ref)


# --------------------------------------------------------------------------------------------------------------
# npu_dynamic_quant (per-token symmetric int8)


def _dynamic_quant_npu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch_npu

    return torch_npu.npu_dynamic_quant(x)


def _dynamic_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale = rowmax(|x|) / 127`` (float32, shape ``x.shape[:-1]``), ``y = int8(round(x / scale))``.

    An all-zero row gets scale 0 and y 0 (the docs do not cover it; its product is 0 either way).
    """
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.clamp(torch.round(xf / safe.unsqueeze(-1)), -127, 127).to(torch.int8)
    return y, scale


dynamic_quant = Kernel("npu_dynamic_quant", npu=_dynamic_quant_npu, reference=_dynamic_quant_ref)


# --------------------------------------------------------------------------------------------------------------
# npu_quant_matmul


def _quant_matmul_npu(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    pertoken_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_quant_matmul(
        x1, x2, scale, pertoken_scale=pertoken_scale, bias=bias, output_dtype=output_dtype
    )


def _quant_matmul_ref(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    pertoken_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """``acc = x1 @ x2`` in int32; an int32 ``bias`` is added to ``acc``; ``out = acc * scale[n] (* pertoken[m])``;
    a float ``bias`` is added after dequantization; cast to ``output_dtype``.

    x1 ``[M, K]`` int8 with x2 ``[K, N]`` int8, or the int4 form: x1 int32 ``[M, K/8]`` with x2 int32 ``[K/8, N]``
    (the transpose of a contiguous ``[N, K/8]``). ``scale`` is float32/bfloat16 ``[N]`` or ``[1]``, or int64
    (``npu_trans_quant_param``).
    """
    if x1.dtype != x2.dtype or x1.dtype not in (torch.int8, torch.int32):
        raise KernelContractError(f"npu_quant_matmul: x1 {x1.dtype} and x2 {x2.dtype} must both be int8 or int32")
    if x1.dtype == torch.int32:
        a = unpack_int4(x1.contiguous())
        b = unpack_int4(x2.t().contiguous()).t()
    else:
        a, b = x1, x2
    if a.shape[-1] != b.shape[0]:
        raise KernelContractError(f"npu_quant_matmul: x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} do not chain")
    # float64 products and sums of int8/int4 values are exact (|acc| < 2**53), and BLAS-fast unlike int32 matmul.
    acc = a.to(torch.float64) @ b.to(torch.float64)
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.to(torch.float64)
    out = acc.to(torch.float32) * decode_scale(scale)
    if pertoken_scale is not None:
        out = out * pertoken_scale.to(torch.float32).unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.to(torch.float32)
    return out.to(output_dtype)


quant_matmul = Kernel("npu_quant_matmul", npu=_quant_matmul_npu, reference=_quant_matmul_ref)


# --------------------------------------------------------------------------------------------------------------
# npu_convert_weight_to_int4pack


def _int4pack_npu(weight: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_convert_weight_to_int4pack(weight.to(torch.int32).contiguous(), inner_k_tiles=0)


def _int4pack_ref(weight: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7] ``[R, C]`` -> int32 ``[R, C/8]`` (see the module docstring for the nibble order)."""
    return pack_int4(weight)


int4pack = Kernel("npu_convert_weight_to_int4pack", npu=_int4pack_npu, reference=_int4pack_ref)


# --------------------------------------------------------------------------------------------------------------
# npu_weight_quant_batchmatmul (weight-only int4, per-group)


def _weight_quant_bmm_npu(
    x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_weight_quant_batchmatmul(
        x, weight, antiquant_scale=antiquant_scale, antiquant_group_size=group_size
    )


def _weight_quant_bmm_ref(
    x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``y = x @ W_f`` with ``W_f[k, n] = W_int4[k, n] * antiquant_scale[k // group_size, n]``.

    x ``[M, K]``; weight int32 ``[K, N/8]``; antiquant_scale ``[ceil(K/g), N]`` in x's dtype (``group_size`` 0 means
    per-channel, scale ``[1, N]``). Output in x's dtype.
    """
    w = unpack_int4(weight).to(torch.float32)
    k, n = w.shape
    if x.shape[-1] != k:
        raise KernelContractError(
            f"npu_weight_quant_batchmatmul: x {tuple(x.shape)} and weight [K={k}, N={n}] differ in K"
        )
    s = antiquant_scale.to(torch.float32)
    if group_size:
        s = s.repeat_interleave(group_size, dim=0)[:k]
    if s.shape[-1] != n:
        raise KernelContractError(
            f"npu_weight_quant_batchmatmul: antiquant_scale {tuple(antiquant_scale.shape)} vs N={n}"
        )
    return (x.to(torch.float32) @ (w * s)).to(x.dtype)


weight_quant_batchmatmul = Kernel(
    "npu_weight_quant_batchmatmul", npu=_weight_quant_bmm_npu, reference=_weight_quant_bmm_ref
)


# --------------------------------------------------------------------------------------------------------------
# npu_kronecker_quant (FlatQuant activation transform + dynamic int4 quant)

KRONECKER_MAX_ROWS = 32768  # the op's dim-0 limit; larger inputs go in chunks


def _kronecker_quant_npu(
    x: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, clip_ratio: float
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch_npu

    outs, scales = [], []
    for chunk in torch.split(x, KRONECKER_MAX_ROWS, dim=0):
        q, s = torch_npu.npu_kronecker_quant(chunk, p1, p2, clip_ratio=clip_ratio, dst_dtype=torch.int32)
        outs.append(q)
        scales.append(s)
    return torch.cat(outs, 0), torch.cat(scales, 0)


def _kronecker_quant_ref(
    x: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, clip_ratio: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[T, L, R]`` (R % 8 == 0), p1 ``[L, L]``, p2 ``[R, R]`` -> (int32 ``[T, L, R/8]``, float32 ``[T]``).

    ASSUMPTION (the docs say only "two successive small matmuls, then quantize"; to be confirmed on an NPU):
    ``y_t = p1 @ x_t @ p2``, then symmetric int4 per token: ``scale_t = clip_ratio * max|y_t| / 7``,
    ``q = clamp(round(y / scale_t), -8, 7)``, packed 8 per int32 along R. With p1 = FlatQuant's left matrix
    *transposed* (done at load) this is ``x (P_left ⊗ P_right)`` in row-major flattening.
    """
    t, rows, cols = x.shape
    if p1.shape != (rows, rows) or p2.shape != (cols, cols) or cols % 8:
        raise KernelContractError(
            f"npu_kronecker_quant: x {tuple(x.shape)}, p1 {tuple(p1.shape)}, p2 {tuple(p2.shape)}: need p1 [L,L], "
            "p2 [R,R], R % 8 == 0"
        )
    y = p1.to(torch.float32) @ x.to(torch.float32) @ p2.to(torch.float32)
    scale = y.abs().amax(dim=(1, 2)) * float(clip_ratio) / 7.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(y / safe.view(t, 1, 1)), -8, 7)
    return pack_int4(q), scale


kronecker_quant = Kernel("npu_kronecker_quant", npu=_kronecker_quant_npu, reference=_kronecker_quant_ref)
