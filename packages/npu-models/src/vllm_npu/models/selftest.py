# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu selftest`` cases for the models layer's kernel pairs: the gated delta-net kernels of Qwen3-Next (see
:mod:`vllm_npu.interface.selftest`).

Sizes: Qwen3-Next-80B-A3B per rank at TP=4 (GDN 4 key heads / 8 value heads of 128, conv channels 2048, kernel 4)
and a small shape with grouped heads. The state pools are passed as the layer passes them: the conv pool as the
transposed view ``[slots, D, W - 1]`` of its ``[slots, W - 1, D]`` storage; slot 0 is left to padding. The prefill
pairs (conv1d prefill, chunked rule) run a torch computation on both sides (vllm-ascend runs torch there too): their
rows confirm the torch ops on the device. The decode pairs' NPU side is vLLM's Triton kernels through Triton-Ascend.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm_npu.interface import KernelCall, KernelCase, randn

from .gdn_conv import CAUSAL_CONV1D_PREFILL, CAUSAL_CONV1D_UPDATE
from .gdn_delta import CHUNK_GATED_DELTA_RULE, FUSED_RECURRENT_GATED_DELTA_RULE
from .gdn_norm import GDN_GATING, RMS_NORM_GATED

#: (label, key heads, value heads, head dim) per rank.
SHAPES = (("qwen3-next-80b/tp4", 4, 8, 128), ("grouped", 2, 4, 32))
DTYPES = ("bfloat16", "float32")
LENS = (5, 70, 1)  # ragged prefill: within a chunk, across a chunk boundary, one token
WIDTH = 4


def _dt(name: str) -> torch.dtype:
    return getattr(torch, name)


def _tol(dtype: str) -> tuple[float, float] | None:
    return (3e-2, 3e-2) if dtype == "bfloat16" else None


def _loc(device: Any) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _qkvgb(seed: int, tokens: int, h: int, hv: int, d: int, dtype: torch.dtype, device: Any) -> tuple[Any, ...]:
    q = randn(seed, tokens, h, d, dtype=dtype, device=device)
    k = randn(seed + 1, tokens, h, d, dtype=dtype, device=device)
    v = randn(seed + 2, tokens, hv, d, dtype=dtype, device=device)
    g = -randn(seed + 3, tokens, hv, dtype=torch.float32, device=device).abs()
    beta = randn(seed + 4, tokens, hv, dtype=dtype, device=device).sigmoid()
    return q, k, v, g, beta


def _with_pool(index: int, slots: list[int], rows: int | None = None) -> Any:
    """The output (its first ``rows`` rows: a padded row's output is left open by the contract) and the pool's
    ``slots`` (the null slot 0 is not compared: padding may write there)."""

    def outputs(result: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        return {"out": result if rows is None else result[:rows], "state": args[index][slots]}

    return outputs


def selftest_cases() -> list[KernelCase]:
    cases = []
    for label, h, hv, d in SHAPES:
        conv_dim = 2 * h * d + hv * d
        for dtype in DTYPES:
            dt, tol = _dt(dtype), _tol(dtype)

            def conv_prefill(device: Any, c: int = conv_dim, t: torch.dtype = dt) -> KernelCall:
                pool = randn(10, 4, WIDTH - 1, c, dtype=t, device=device).transpose(-1, -2)
                args = (
                    randn(11, sum(LENS), c, dtype=t, device=device),
                    randn(12, c, WIDTH, dtype=t, device=device, scale=0.5),
                    None,
                    pool,
                    _loc(device),
                    torch.tensor([3, 1, 2], dtype=torch.int32, device=device),
                    torch.tensor([True, False, True], device=device),
                    "silu",
                )
                return KernelCall(args, {}, _with_pool(3, [1, 2, 3]))

            def conv_update(device: Any, c: int = conv_dim, t: torch.dtype = dt) -> KernelCall:
                pool = randn(20, 5, WIDTH - 1, c, dtype=t, device=device).transpose(-1, -2)
                slots = torch.tensor([4, 2, 1, -1], dtype=torch.int32, device=device)  # the last row is padding
                args = (randn(21, 4, c, dtype=t, device=device), pool, randn(22, c, WIDTH, dtype=t, device=device),
                        None, "silu", slots)  # fmt: skip
                return KernelCall(args, {}, _with_pool(1, [1, 2, 4], rows=3))

            def chunk(device: Any, hh: int = h, hvv: int = hv, dd: int = d, t: torch.dtype = dt) -> KernelCall:
                pool = randn(30, 4, hvv, dd, dd, dtype=t, device=device, scale=0.1)
                args = (
                    *_qkvgb(31, sum(LENS), hh, hvv, dd, t, device),
                    pool,
                    _loc(device),
                    torch.tensor([3, 1, 2], dtype=torch.int32, device=device),
                    torch.tensor([True, False, True], device=device),
                    True,
                )
                return KernelCall(args, {}, _with_pool(5, [1, 2, 3]))

            def recurrent(device: Any, hh: int = h, hvv: int = hv, dd: int = d, t: torch.dtype = dt) -> KernelCall:
                pool = randn(40, 6, hvv, dd, dd, dtype=t, device=device, scale=0.1)
                args = (
                    *_qkvgb(41, 3, hh, hvv, dd, t, device),
                    pool,
                    torch.arange(4, dtype=torch.int32, device=device),
                    torch.tensor([5, 2, 3], dtype=torch.int32, device=device),
                    None,
                    True,
                )
                return KernelCall(args, {}, _with_pool(5, [2, 3, 5]))

            def norm(device: Any, dd: int = d, hvv: int = hv, t: torch.dtype = dt) -> KernelCall:
                rows = 7 * hvv
                args = (randn(50, rows, dd, dtype=t, device=device), randn(51, rows, dd, dtype=t, device=device),
                        randn(52, dd, dtype=t, device=device, scale=0.2) + 1, 1e-6)  # fmt: skip
                return KernelCall(args, {})

            def gating(device: Any, hvv: int = hv, t: torch.dtype = dt) -> KernelCall:
                args = (randn(60, hvv, dtype=torch.float32, device=device), randn(61, 9, hvv, dtype=t, device=device),
                        randn(62, 9, hvv, dtype=t, device=device), randn(63, hvv, dtype=t, device=device))  # fmt: skip
                return KernelCall(args, {})

            shape = f"{label}: H={h} HV={hv} D={d}"
            cases += [
                KernelCase(CAUSAL_CONV1D_PREFILL, f"{label}: D={conv_dim} W={WIDTH} lens={LENS}", dtype, conv_prefill, tol),
                KernelCase(CAUSAL_CONV1D_UPDATE, f"{label}: D={conv_dim} W={WIDTH} batch 4 (1 padded)", dtype,
                           conv_update, tol),
                KernelCase(CHUNK_GATED_DELTA_RULE, f"{shape} lens={LENS}", dtype, chunk, tol),
                KernelCase(FUSED_RECURRENT_GATED_DELTA_RULE, f"{shape} decode batch 3", dtype, recurrent, tol),
                KernelCase(RMS_NORM_GATED, f"{label}: rows {7 * hv} x {d}", dtype, norm, tol),
                KernelCase(GDN_GATING, f"{label}: 9 tokens x HV={hv}", dtype, gating, tol),
            ]  # fmt: skip
    return cases
