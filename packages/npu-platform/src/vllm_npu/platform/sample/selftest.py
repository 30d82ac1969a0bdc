# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Selftest cases of the platform's kernel pairs (:data:`.topk_topp.TOP_K_TOP_P`, :data:`.grammar.GRAMMAR_BITMASK`),
collected by the platform door's ``selftest_cases`` (see :mod:`vllm_npu.interface.selftest`)."""

from __future__ import annotations

from typing import Any

import torch
from vllm_npu.interface import KernelCall, KernelCase, randn

from .grammar import GRAMMAR_BITMASK
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


def _masked_in_place(result: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    return _masked(args[0], args, kwargs)


def grammar_bitmask_cases() -> list[KernelCase]:
    """Qwen-sized vocabulary (151936, 4748 bitmask words), 10 logit rows: every row masked (the in-place path), and
    the rows of a batch where two requests are structured, one with 2 draft tokens (rows 2-4) and one without (row
    7). Random bitmask words, all 32 bits of a word included (bit 31 is the int32 sign bit)."""
    n, vocab = 10, 151936
    words = (vocab + 31) // 32
    cases = []
    for dtype in _DTYPES:
        for label, rows in (("every row", list(range(n))), ("rows [2, 3, 4, 7]", [2, 3, 4, 7])):

            def build(device: Any, d: str = dtype, r: list[int] = rows) -> KernelCall:
                logits = randn(61, n, vocab, dtype=_DTYPES[d], device=device)
                gen = torch.Generator().manual_seed(62)
                bitmask = torch.randint(-(2**31), 2**31 - 1, (len(r), words), dtype=torch.int32, generator=gen)
                return KernelCall((logits, list(r), bitmask), {}, _masked_in_place)

            cases.append(
                KernelCase(
                    GRAMMAR_BITMASK,
                    f"logits [{n}, {vocab}], bitmask [{len(rows)}, {words}], {label}",
                    dtype,
                    build,
                    note="structured output's bitmask unpacked and applied on the NPU == xgrammar's CPU kernel",
                )
            )
    return cases


def selftest_cases() -> list[KernelCase]:
    """Every platform kernel pair over its grid of shapes and dtypes."""
    return top_k_top_p_cases() + grammar_bitmask_cases()
