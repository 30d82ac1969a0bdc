# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Selftest cases of the platform's kernel pairs (:data:`.topk_topp.TOP_K_TOP_P`), collected by the platform door's
``selftest_cases`` (see :mod:`vllm_npu.interface.selftest`)."""

from __future__ import annotations

from typing import Any

import torch
from vllm_npu.interface.selftest import KernelCall, KernelCase, randn

from .topk_topp import NPU_TOP_K_MAX, TOP_K_TOP_P

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _masked(result: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The kept logits (masked entries as 0, so -inf never meets -inf in a difference) and the kept count per row."""
    dropped = torch.isinf(result) & (result < 0)
    return {"kept_logits": result.float().masked_fill(dropped, 0.0), "kept": (~dropped).sum(-1)}


def top_k_top_p_cases() -> list[KernelCase]:
    """Qwen-sized vocabulary (151936), 6 rows: k at both ends of the op's range and between, p from 0 (top-1) to 1
    (no top-p); top-k alone, top-p alone, both. Logits scaled by 4 so that the top-p boundary is not a near tie."""
    batch, vocab = 6, 151936
    ks = [1, 2, 20, 50, 1000, NPU_TOP_K_MAX]
    ps = [0.0, 0.5, 0.8, 0.9, 0.95, 1.0]
    cases = []
    for dtype in _DTYPES:
        for mode in ("k", "p", "k+p"):

            def build(device: Any, d: str = dtype, m: str = mode) -> KernelCall:
                logits = randn(60, batch, vocab, dtype=_DTYPES[d], device=device, scale=4.0)
                k = torch.tensor(ks, dtype=torch.int32, device=device) if "k" in m else None
                p = torch.tensor(ps, dtype=torch.float32, device=device) if "p" in m else None
                return KernelCall((logits, k, p), {}, _masked)

            cases.append(
                KernelCase(
                    TOP_K_TOP_P,
                    f"logits [{batch}, {vocab}], {mode}: k {ks}, p {ps}",
                    dtype,
                    build,
                    note="vLLM's sampler masking (forward_native) on npu_top_k_top_p; the k range and (p, k) order",
                )
            )
    return cases


def selftest_cases() -> list[KernelCase]:
    """Every platform kernel pair over its grid of shapes and dtypes."""
    return top_k_top_p_cases()
