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

import torch
from vllm_npu.interface.device import Kernel
from vllm_npu.interface.errors import KernelContractError

from ._reference import attend, window_allowed


def _no_soft_cap(logits_soft_cap: float | None, op: str) -> None:
    if logits_soft_cap:
        raise KernelContractError(f"{op}: torch_npu has no attention kernel with logits soft-capping")


def _check_packing(total: int, offsets: list[int], op: str) -> None:
    if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise KernelContractError(f"{op}: sequence offsets {offsets[:4]}... do not pack the {total} tokens")


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
    attn_mask: torch.Tensor,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
) -> None:
    _no_soft_cap(logits_soft_cap, "prefill_no_cache")
    import torch_npu

    torch_npu.atb._npu_flash_attention_v2(
        query,
        key,
        value,
        seq_lens,
        mask=attn_mask,
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
    offsets = [0]
    for n in seq_lens:
        offsets.append(offsets[-1] + n)
    _check_packing(query.shape[0], offsets, "prefill_no_cache")
    if query.shape[1] != num_heads or key.shape[1] != num_kv_heads:
        raise KernelContractError(
            f"prefill_no_cache: got {query.shape[1]} query and {key.shape[1]} KV heads, "
            f"expected {num_heads} and {num_kv_heads}"
        )
    for start, end in zip(offsets, offsets[1:]):
        if end == start:
            continue
        pos = torch.arange(end - start, device=query.device)
        allowed = window_allowed(pos, pos, causal=True, sliding_window=None)
        o = attend(query[start:end], key[start:end], value[start:end], allowed, scale, logits_soft_cap)
        out[start:end] = o.to(out.dtype)


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
    attn_mask: torch.Tensor,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    _no_soft_cap(logits_soft_cap, "encoder_attention")
    import torch_npu

    band = max_query_len if sliding_window is None else sliding_window - 1
    cu = query_start_loc[1:]
    attn_out = torch_npu.npu_fusion_attention(
        query,
        key,
        value,
        num_heads,
        "TND",
        atten_mask=attn_mask,
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
    _check_packing(query.shape[0], query_start_loc, "encoder_attention")
    if query.shape[1] != num_heads or key.shape[1] != num_kv_heads:
        raise KernelContractError(
            f"encoder_attention: got {query.shape[1]} query and {key.shape[1]} KV heads, "
            f"expected {num_heads} and {num_kv_heads}"
        )
    for start, end in zip(query_start_loc, query_start_loc[1:]):
        if end == start:
            continue
        allowed = None
        if sliding_window is not None:
            pos = torch.arange(end - start, device=query.device)
            allowed = window_allowed(pos, pos, causal=False, sliding_window=sliding_window)
        o = attend(query[start:end], key[start:end], value[start:end], allowed, scale, logits_soft_cap)
        out[start:end] = o.to(out.dtype)


ENCODER_ATTENTION = Kernel(
    "encoder_attention", npu=encoder_attention_npu, reference=encoder_attention_reference
)
