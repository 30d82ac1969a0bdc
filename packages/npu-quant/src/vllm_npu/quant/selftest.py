# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu selftest`` cases for the quant layer's kernel pairs (see :mod:`vllm_npu.interface.selftest`).

Inputs are what the schemes pass after loading an msModelSlim checkpoint: int8 weights transposed to ``[K, N]``,
per-channel float32 dequant scales (int64 ``npu_trans_quant_param`` form for float16 output), int32 quant biases,
per-token float32 activation scales, int4 packed 8 per int32 (with the reference packing, whose agreement with
``npu_convert_weight_to_int4pack`` is its own row), group size 128 for W4A8, and the documented scale/output dtype
pairings of ``npu_grouped_matmul`` (bfloat16 output with a bfloat16 scale, float16 output with a float32 scale).
Quantizer outputs may differ by one step (``int_atol=1``): the docs do not state the rounding of exact ties.
A case's note ``audit #n`` points at the call marked ``#n`` in the status column of ``docs/npu-calls.md``.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm_npu.interface import KernelCall, KernelCase, randn

from . import kernels
from .moe_experts import grouped_quant_matmul, grouped_static_matmul, quantize_rows
from .moe_w4a8 import grouped_a8w4_matmul

HALVES = ("bfloat16", "float16")
COUNTS = [3, 0, 6, 2]  # rows per expert, one expert without rows


def _dt(name: str) -> torch.dtype:
    return getattr(torch, name)


def _ints(seed: int, *shape: int, low: int, high: int, device: Any) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, shape, generator=gen).to(device)


def _int8(seed: int, *shape: int, device: Any) -> torch.Tensor:
    return _ints(seed, *shape, low=-127, high=127, device=device).to(torch.int8)


def _scale(seed: int, *shape: int, device: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Positive scales around 1e-2 (what a dequant or weight scale looks like)."""
    return (randn(seed, *shape, dtype=torch.float32, device="cpu", scale=0.3).exp() * 1e-2).to(
        dtype=dtype, device=device
    )


def _unpacked(result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """Kronecker quant outputs with the int4 values unpacked: a one-step difference stays a one-step difference."""
    q, scale = result
    return {"q (int4 values)": kernels.unpack_int4(q.cpu()), "scale": scale}


def _scalar_cases() -> list[KernelCase]:
    cases = []

    def trans(device: Any) -> KernelCall:
        return KernelCall((_scale(100, 4096, device=device),), {})

    cases.append(KernelCase(kernels.trans_quant_param, "scale [4096] -> int64", "float32", trans, note="audit #34"))

    def to_nz(device: Any) -> KernelCall:
        gen = torch.Generator().manual_seed(101)
        return KernelCall((torch.randint(-128, 128, (1024, 512), generator=gen, dtype=torch.int8).to(device),), {})

    cases.append(
        KernelCase(kernels.weight_to_nz, "int8 weight [1024, 512] -> FRACTAL_NZ", "int8", to_nz, note="310P W8A8")
    )
    for dtype in HALVES:

        def quantize(device: Any, dt: str = dtype) -> KernelCall:
            k = 4096
            x = randn(101, 7, k, dtype=_dt(dt), device=device)
            inv = torch.full((k,), 1 / 0.031, dtype=_dt(dt), device=device)
            off = torch.full((k,), 3.0, dtype=_dt(dt), device=device)
            return KernelCall((x, inv, off), {})

        def dyn(device: Any, dt: str = dtype) -> KernelCall:
            x = randn(102, 9, 4096, dtype=_dt(dt), device=device)
            x[3] = 0  # an all-zero row
            return KernelCall((x,), {})

        def rows(device: Any, dt: str = dtype) -> KernelCall:
            n = sum(COUNTS)
            x = randn(103, n, 1024, dtype=_dt(dt), device=device)
            inv = (1 / _scale(104, n, device="cpu") / 3).to(dtype=_dt(dt), device=device)
            off = _ints(105, n, low=-3, high=3, device=device).to(_dt(dt))
            return KernelCall((x, inv, off), {})

        cases += [
            KernelCase(
                kernels.quantize_per_tensor,
                "x [7, 4096], scale/offset [4096]",
                dtype,
                quantize,
                int_atol=1,
                note="audit #33",
            ),
            KernelCase(kernels.dynamic_quant, "x [9, 4096] (one zero row)", dtype, dyn, int_atol=1, note="audit #35"),
            KernelCase(
                quantize_rows,
                f"x [{sum(COUNTS)}, 1024], per-row scale/offset",
                dtype,
                rows,
                int_atol=1,
                note="audit #44",
            ),
        ]
    return cases


def _matmul_cases() -> list[KernelCase]:
    cases = []
    m, k, n = 7, 1024, 512
    for dtype in HALVES:

        def static(device: Any, dt: str = dtype) -> KernelCall:
            scale = _scale(110, n, device=device)
            if dt == "float16":  # the documented form for float16 output: the int64 (FP19) scale
                scale = kernels._trans_quant_param_ref(scale.cpu()).to(device)
            bias = _ints(111, n, low=-5000, high=5000, device=device).to(torch.int32)
            w = _int8(112, n, k, device=device).t()  # [K, N], the transpose of the checkpoint's [N, K]
            return KernelCall((_int8(113, m, k, device=device), w, scale, None, bias, _dt(dt)), {})

        def dynamic(device: Any, dt: str = dtype) -> KernelCall:
            w = _int8(114, n, k, device=device).t()
            pertoken = _scale(115, m, device=device)
            return KernelCall(
                (_int8(116, m, k, device=device), w, _scale(117, n, device=device), pertoken, None, _dt(dt)), {}
            )

        def w4a4(device: Any, dt: str = dtype) -> KernelCall:
            x = kernels.pack_int4(_ints(118, m, k, low=-8, high=7, device="cpu")).to(device)
            w = kernels.pack_int4(_ints(119, n, k, low=-8, high=7, device="cpu")).to(device).t()
            return KernelCall((x, w, _scale(120, n, device=device), _scale(121, m, device=device), None, _dt(dt)), {})

        def pack(device: Any, dt: str = dtype) -> KernelCall:
            return KernelCall((_ints(122, k, n, low=-8, high=7, device=device).to(torch.int32),), {})

        def w4a8(device: Any, dt: str = dtype) -> KernelCall:
            group = 128
            w = kernels.pack_int4(_ints(123, k, n, low=-8, high=7, device="cpu")).to(device)
            scale = _scale(124, k // group, n, device=device, dtype=_dt(dt))
            return KernelCall((randn(125, m, k, dtype=_dt(dt), device=device), w, scale, group), {})

        def kron(device: Any, dt: str = dtype) -> KernelCall:
            rows, cols = 32, 128  # a 4096 hidden size as 32 x 128
            p1 = torch.linalg.qr(randn(126, rows, rows, dtype=torch.float32, device="cpu"))[0].to(
                device=device, dtype=_dt(dt)
            )
            p2 = torch.linalg.qr(randn(127, cols, cols, dtype=torch.float32, device="cpu"))[0].to(
                device=device, dtype=_dt(dt)
            )
            return KernelCall((randn(128, 5, rows, cols, dtype=_dt(dt), device=device), p1, p2, 0.9), {}, _unpacked)

        scale_form = "int64 scale" if dtype == "float16" else "fp32 scale"
        cases += [
            KernelCase(
                kernels.quant_matmul,
                f"W8A8 x [{m}, {k}] W [{k}, {n}], {scale_form}, int32 bias",
                dtype,
                static,
                note="audit #36",
            ),
            KernelCase(
                kernels.quant_matmul,
                f"W8A8_DYNAMIC x [{m}, {k}] W [{k}, {n}], per-token",
                dtype,
                dynamic,
                note="audit #37",
            ),
            KernelCase(
                kernels.quant_matmul,
                f"W4A4 x [{m}, {k}/8] W [{k}/8, {n}] int32, per-token",
                dtype,
                w4a4,
                note="audit #38",
            ),
            KernelCase(
                kernels.weight_quant_batchmatmul,
                f"W4A8 x [{m}, {k}] W int4 [{k}, {n}/8], group 128",
                dtype,
                w4a8,
                note="audit #40",
            ),
            KernelCase(kernels.kronecker_quant, "x [5, 32, 128], clip 0.9", dtype, kron, int_atol=1, note="audit #41"),
        ]
        if dtype == "bfloat16":
            cases.append(KernelCase(kernels.int4pack, f"W [{k}, {n}] -> [{k}, {n}/8]", "int32", pack, note="audit #39"))
    return cases


def _grouped_cases() -> list[KernelCase]:
    cases = []
    g, k, n = len(COUNTS), 512, 256
    rows = sum(COUNTS)
    counts = torch.tensor(COUNTS, dtype=torch.int64)
    for dtype in HALVES:
        # the documented pairing: bfloat16 output takes a bfloat16 scale, float16 output a float32 one
        scale_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32

        def per_token(device: Any, dt: str = dtype, sd: torch.dtype = scale_dtype) -> KernelCall:
            w = _int8(130, g, n, k, device=device).transpose(1, 2)  # [G, K, N] view of [G, N, K]
            args = (
                _int8(131, rows, k, device=device),
                w,
                _scale(132, g, n, device=device, dtype=sd),
                _scale(133, rows, device=device),
                counts.to(device),
                _dt(dt),
            )
            return KernelCall(args, {})

        def a8w4(device: Any, dt: str = dtype) -> KernelCall:
            # vllm-ascend v0.11.0's W4A8 expert call: int8 rows x int4 weights, int64 scale, float32 bias
            group = 128
            w4 = torch.stack([_ints(134 + e, k, n, low=-8, high=7, device="cpu") for e in range(g)])  # [E, K, N]
            s = _scale(140, g, k // group, n, device="cpu").to(torch.float16).to(torch.float32)
            bias = 8 * (w4.float().reshape(g, k // group, group, n).sum(2) * s).sum(1)  # the exact offset
            args = (
                _int8(141, rows, k, device=device),
                kernels.pack_int4(w4).to(device),
                kernels.encode_scale(s).to(device),
                bias.to(device),
                _scale(142, rows, device=device),
                counts.to(device),
                _dt(dt),
            )
            return KernelCall(args, {})

        def static(device: Any, dt: str = dtype, sd: torch.dtype = scale_dtype) -> KernelCall:
            w = _int8(142, g, n, k, device=device).transpose(1, 2)
            bias = _ints(143, g, n, low=-5000, high=5000, device=device).to(torch.int32)
            args = (
                _int8(144, rows, k, device=device),
                w,
                _scale(145, g, n, device=device, dtype=sd),
                bias,
                counts.to(device),
                _dt(dt),
            )
            return KernelCall(args, {})

        sd_name = str(scale_dtype).removeprefix("torch.")
        cases += [
            KernelCase(
                grouped_quant_matmul,
                f"xq [{rows}, {k}] W [{g}, {k}, {n}] counts {COUNTS}, {sd_name} scale",
                dtype,
                per_token,
                note="audit #42",
            ),
            KernelCase(
                grouped_a8w4_matmul,
                f"xq [{rows}, {k}] W int4 [{g}, {k}, {n}/8] group 128, int64 scale, float32 bias",
                dtype,
                a8w4,
                note="audit #43",
            ),
            KernelCase(
                grouped_static_matmul,
                f"xq [{rows}, {k}] W [{g}, {k}, {n}], {sd_name} scale, int32 bias",
                dtype,
                static,
                note="audit #45",
            ),
        ]
    return cases


def selftest_cases() -> list[KernelCase]:
    """Every quant kernel pair over its grid of shapes and dtypes."""
    return [*_scalar_cases(), *_matmul_cases(), *_grouped_cases()]
