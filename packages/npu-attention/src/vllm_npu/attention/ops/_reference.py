# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Shared math of the reference attention kernels: fp32 softmax attention with GQA, masks from positions.

Layouts follow vLLM: tokens ``[T, N, D]`` for queries, ``[T, Nkv, D]`` for keys/values, paged caches
``[num_blocks, block_size, Nkv, D]``. GQA maps query head ``h`` to KV head ``h // (N // Nkv)``: the query heads are
viewed as ``[Nkv, N // Nkv]``, so no K/V copy per query head is made.
"""

from __future__ import annotations

import torch

# Large finite negative instead of -inf: a query row whose keys are all masked (only padding rows of a batched
# group, which are discarded) then yields a finite uniform average instead of NaN.
_MASKED = torch.finfo(torch.float32).min


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    logits_soft_cap: float | None = None,
    *,
    masked: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(scale * q k^T [soft-capped], masked) v`` in fp32.

    query ``[*B, Sq, N, D]``, key/value ``[*B, Sk, Nkv, D]`` (any float dtype), ``allowed`` a bool mask
    ``[*B, Sq, Sk]`` (True = attend) or None; or instead ``masked``, its complement already shaped for the scores
    ``[*B, Nkv, G, Sq, Sk]`` (broadcastable, True = hidden: what a metadata builder prepares once per step).
    Returns fp32 ``[*B, Sq, N, D]``. ``N`` must be a multiple of ``Nkv``.

    Two batched matmuls over ``[*B, Nkv, G * Sq, D]`` (the GQA group folded into the rows, no K/V copy per query
    head): the same GEMMs ``torch.einsum`` dispatches to for this contraction, so the bits are einsum's.
    """
    *batch, sq, n, d = query.shape
    nkv = key.shape[-2]
    if n % nkv:
        raise ValueError(f"num_heads={n} is not a multiple of num_kv_heads={nkv}")
    g = n // nkv
    q = query.float().reshape(*batch, sq, nkv, g, d)
    if sq > 1:
        q = q.movedim(-4, -2)  # [*B, Nkv, G, Sq, D]
    q = q.reshape(*batch, nkv, g * sq, d)
    scores = torch.matmul(q, key.float().movedim(-3, -1)).view(*batch, nkv, g, sq, -1) * scale
    if logits_soft_cap:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    if masked is None and allowed is not None:
        masked = ~allowed[..., None, None, :, :]
    if masked is not None:
        scores = scores.masked_fill(masked, _MASKED)
    probs = torch.softmax(scores, dim=-1).view(*batch, nkv, g * sq, -1)
    out = torch.matmul(probs, value.float().movedim(-3, -2)).view(*batch, nkv, g, sq, d)
    if sq > 1:
        out = out.movedim(-2, -4)  # [*B, Sq, Nkv, G, D]
    return out.reshape(*batch, sq, n, d)


def window_allowed(
    q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, sliding_window: int | None
) -> torch.Tensor:
    """Bool mask ``[..., Sq, Sk]`` from absolute positions ``q_pos [..., Sq]`` and ``k_pos [..., Sk]``.

    Causal: key ``j`` is visible to query ``i`` when ``j <= i`` and, with a window ``W``, ``j > i - W`` (the query
    sees ``W`` keys including itself, vLLM's ``(W - 1, 0)``). Non-causal with a window: ``|i - j| < W``.
    """
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    if causal:
        allowed = diff >= 0
        if sliding_window is not None:
            allowed &= diff < sliding_window
        return allowed
    if sliding_window is None:
        return torch.ones_like(diff, dtype=torch.bool)
    return diff.abs() < sliding_window


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` cached tokens of each row of ``block_table``.

    cache ``[num_blocks, block_size, Nkv, D]``, block_table ``[B, max_blocks]`` (int) -> ``[B, L, Nkv, D]`` with
    ``L = ceil(num_tokens / block_size) * block_size`` (the tail past each row's own length is whatever the pages
    hold; callers mask it).
    """
    block_size = cache.shape[1]
    num_blocks = max(1, -(-num_tokens // block_size))
    pages = cache[block_table[:, :num_blocks].long()]  # [B, nb, bs, Nkv, D]
    return pages.flatten(1, 2)


def gather_sequence(cache: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's first ``seq_len`` cached tokens: ``[seq_len, Nkv, D]``."""
    return gather_pages(cache, block_row[None], seq_len)[0, :seq_len]
