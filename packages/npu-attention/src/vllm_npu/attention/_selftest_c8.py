# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu selftest`` cases of the int8 KV cache (C8, :mod:`.ops.c8_cache`): what only an Ascend host can
confirm -- ``npu_quantize``'s rounding into the int8 pages, and FIA's in-kernel antiquant with per-channel scales in
the BSH decode (``[2, H]``, the query dtype) and the TND prefill (``[2, Nkv, D]``, float16)."""

from __future__ import annotations

from functools import partial
from itertools import accumulate
from typing import Any

import torch
from vllm_npu.interface import KernelCall, KernelCase, randn

from . import _selftest_kit as kit
from ._selftest_kit import HALVES
from .masks import AttentionMaskBuilder
from .ops.c8_cache import C8_KV_WRITE, C8_PAGED_DECODE, C8_PAGED_PREFILL


def _int8_pages(seed: int, nb: int, bs: int, nkv: int, d: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``(2, nb, bs, Nkv, D)`` int8 buffer unbound into K and V pages, as the GQA backend allocates it."""
    pages = (randn(seed, 2, nb, bs, nkv, d, dtype=torch.float32, device="cpu", scale=40.0)).round().clamp(-128, 127)
    k, v = pages.to(torch.int8).to(device).unbind(0)
    return k, v


def _scales(seed: int, nkv: int, d: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Positive per-channel scales ``[Nkv * D]`` float32 (about what calibrated N(0, 1) K/V give: max / 127)."""
    k, v = (randn(seed + i, nkv * d, dtype=torch.float32, device="cpu").abs() * 0.01 + 0.01 for i in range(2))
    return k.to(device), v.to(device)


def _write(device: Any, *, nkv: int, d: int, dt: str) -> KernelCall:
    seq_lens = [5, 130, 1]
    table, nb = kit.block_table(90, seq_lens, 128, device)
    slots = kit.slots(table, kit.new_token_positions([3, 2, 1], seq_lens), 128).to(device)
    kc, vc = _int8_pages(91, nb, 128, nkv, d, device)
    t = slots.numel()
    k, v = (randn(92 + i, t, nkv, d, dtype=kit.dtype_of(dt), device=device) for i in range(2))
    ks, vs = _scales(94, nkv, d, device)
    return KernelCall((k, v, kc, vc, slots, ks, vs), {}, lambda r, a, kw: {"key_cache": a[2], "value_cache": a[3]})


def _decode(device: Any, *, n: int, nkv: int, d: int, dt: str) -> KernelCall:
    context = [1, 37, 300, 129]
    table, nb = kit.block_table(95, context, 128, device)
    kc, vc = _int8_pages(96, nb, 128, nkv, d, device)
    ks, vs = _scales(97, nkv, d, device)
    q = randn(99, len(context), n, d, dtype=kit.dtype_of(dt), device=device)
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, out=torch.zeros_like(q))
    return KernelCall((q, kc, vc, table, ks, vs, context), kw, kit.out_kwarg)


def _prefill(device: Any, *, n: int, nkv: int, d: int, dt: str) -> KernelCall:
    q_lens, seq_lens = [1, 7, 40, 2], [33, 7, 300, 129]  # decode, first prefill, chunked prefill, spec-decode
    table, nb = kit.block_table(100, seq_lens, 128, device)
    kc, vc = _int8_pages(101, nb, 128, nkv, d, device)
    ks, vs = _scales(102, nkv, d, device)
    q = randn(104, sum(q_lens), n, d, dtype=kit.dtype_of(dt), device=device)
    mask = AttentionMaskBuilder(device).splitfuse_mask()
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, attn_mask=mask, out=torch.zeros_like(q))
    return KernelCall((q, kc, vc, table, ks, vs, list(accumulate(q_lens, initial=0)), seq_lens), kw, kit.out_kwarg)


_SHAPES = ({"n": 32, "nkv": 8, "d": 128}, {"n": 8, "nkv": 2, "d": 64})
_NOTE = "issue 30 (C8): docs/npu-calls.md c8_cache rows"


def c8_cases() -> list[KernelCase]:
    """The C8 write (int8 pages within one step: the docs leave the rounding of exact ties open) and the two
    antiquant attention paths, each at a large (8 KV heads of 128) and a small (2 of 64) GQA shape."""
    writes = [
        KernelCase(
            C8_KV_WRITE,
            f"k/v [6, {nkv}, {d}] -> int8 pages [nb, 128, {nkv}, {d}]",
            dt,
            partial(_write, nkv=nkv, d=d, dt=dt),
            int_atol=1,
            note=_NOTE,
        )
        for nkv, d in ((8, 128), (2, 64))
        for dt in HALVES
    ]
    return [
        *writes,
        *kit.grid(
            _SHAPES,
            kit.Spec(C8_PAGED_DECODE, "q [4, {n}, {d}] over int8 pages, context [1, 37, 300, 129]", _decode, _NOTE),
            kit.Spec(
                C8_PAGED_PREFILL,
                "q_lens [1, 7, 40, 2] seq_lens [33, 7, 300, 129] over int8 pages, heads {n}/{nkv} x {d}",
                _prefill,
                _NOTE,
            ),
            dtypes=HALVES,
        ),
    ]
