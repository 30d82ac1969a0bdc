# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Attention over the batch's own keys/values (no cache read): first prefills and encoder-only (pooling) models.

``prefill_no_cache`` — every request is a first prefill (no cached context), causal:
    query ``[T, N, D]``, key/value ``[T, Nkv, D]`` packed per request; seq_lens ``list[int]`` (B, sums to T);
    attn_mask the float causal mask ``[S, S]`` (S >= max seq_len, see :mod:`..masks`; the reference ignores it);
    out ``[T, N, D]`` in place. Token ``i`` of a request sees that request's tokens ``j <= i``.
    NPU: ``torch_npu.atb._npu_flash_attention_v2`` (documented ATB op, ``mask_type=1`` = full float mask,
    fp16/bf16).

``encoder_attention`` — bidirectional attention within each sequence (``AttentionType.ENCODER_ONLY``):
    query ``[T, N, D]``, key/value ``[T, Nkv, D]``; query_start_loc ``list[int]`` (B + 1 cumulative offsets);
    max_query_len; attn_mask the bool 2048 pooling mask (reference ignores it); sliding_window ``W`` (optional)
    restricts to ``|i - j| < W``; out in place.
    NPU: ``torch_npu.npu_fusion_attention`` in TND layout, band mode (``sparse_mode=4``) with
    ``pre_tockens = next_tockens = W - 1`` (or ``max_query_len``, which covers the whole sequence).
"""

from __future__ import annotations

from itertools import accumulate

import torch
from vllm_npu.interface import Kernel

from ._checks import check_heads, check_packing, need_mask, no_soft_cap
from ._reference import attend, window_allowed


def _attend_packed(
    op: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    offsets: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
    causal: bool,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> None:
    """The reference twins' shared body: each sequence ``[offsets[i], offsets[i + 1])`` attends to its own tokens
    (causal and/or within ``sliding_window``, else fully); ``out`` is written in place."""
    check_packing(query.shape[0], offsets, op)
    check_heads(query, key, num_heads, num_kv_heads, op)
    for start, end in zip(offsets, offsets[1:]):
        if end == start:
            continue
        allowed = None
        if causal or sliding_window is not None:
            pos = torch.arange(end - start, device=query.device)
            allowed = window_allowed(pos, pos, causal=causal, sliding_window=sliding_window)
        o = attend(query[start:end], key[start:end], value[start:end], allowed, scale, logits_soft_cap)
        out[start:end] = o.to(out.dtype)


# --- first prefill, causal, no cache ------------------------------------------------------------------------------


def prefill_no_cache_npu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
) -> None:
    no_soft_cap(logits_soft_cap, "prefill_no_cache")
    mask = need_mask(attn_mask, "prefill_no_cache")
    import torch_npu

    torch_npu.atb._npu_flash_attention_v2(
        query,
        key,
        value,
        seq_lens,
        mask=mask,
        mask_type=1,
        scale_value=scale,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        out=out,
    )


def prefill_no_cache_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
) -> None:
    _attend_packed(
        "prefill_no_cache",
        query,
        key,
        value,
        list(accumulate(seq_lens, initial=0)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        scale=scale,
        out=out,
        causal=True,
        sliding_window=None,
        logits_soft_cap=logits_soft_cap,
    )


PREFILL_NO_CACHE = Kernel("prefill_no_cache", npu=prefill_no_cache_npu, reference=prefill_no_cache_reference)


# --- encoder-only (bidirectional) ---------------------------------------------------------------------------------


def encoder_attention_npu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: list[int],
    max_query_len: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    no_soft_cap(logits_soft_cap, "encoder_attention")
    mask = need_mask(attn_mask, "encoder_attention")
    import torch_npu

    band = max_query_len if sliding_window is None else sliding_window - 1
    cu = query_start_loc[1:]
    attn_out = torch_npu.npu_fusion_attention(
        query,
        key,
        value,
        num_heads,
        "TND",
        atten_mask=mask,
        scale=scale,
        pre_tockens=band,
        next_tockens=band,
        actual_seq_qlen=cu,
        actual_seq_kvlen=cu,
        sparse_mode=4,
    )[0]
    out.copy_(attn_out.view_as(out))


def encoder_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: list[int],
    max_query_len: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    _attend_packed(
        "encoder_attention",
        query,
        key,
        value,
        query_start_loc,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        scale=scale,
        out=out,
        causal=False,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )


ENCODER_ATTENTION = Kernel("encoder_attention", npu=encoder_attention_npu, reference=encoder_attention_reference)
