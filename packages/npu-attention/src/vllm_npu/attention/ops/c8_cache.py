# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The int8 KV cache (C8): quantize on write, antiquant inside the attention kernel. Each NPU call beside its twin.

Scales (one checkpoint's, per attention layer): ``k_scale``, ``v_scale`` ``[Nkv * D]`` float32, positive,
per channel (KV head x head dim), symmetric (no offset)::

    int8 = clamp(round(x / scale), -128, 127)        (the write)
    x'   = int8 * scale                               (what attention reads)

``c8_kv_write`` -- key/value ``[T, Nkv, D]`` (float) quantized into the int8 caches ``[num_blocks, block_size, Nkv,
    D]`` at ``slot_mapping [T]`` (slots as :mod:`.kv_cache`: padding already redirected to the null block).
    NPU: ``torch_npu.npu_quantize(x [T, Nkv * D], scale, None, torch.qint8, -1, True)`` (``div_mode=True``:
    ``x / scale``) then ``torch_npu.npu_scatter_nd_update_(cache, [[block, offset]] [T, 2], int8 [T, Nkv, D])``:
    the pair vllm-ascend v0.11.0's ``AscendC8KVCacheMethod.apply`` runs on hardware (``quantization/w8a8.py:395-422``;
    ``quant_per_tensor`` at ``w8a8.py:31-36``). torch_npu 2.8.0 docs: ``npu_quantize`` takes float / bfloat16 scales
    with ``div_mode=True``; ``npu_scatter_nd_update_`` takes int8 on A2/A3.

``c8_paged_decode`` -- one query token per request (DecodeOnly), the contract of :data:`.paged_attention.PAGED_DECODE`
    over int8 caches. NPU: ``npu_fused_infer_attention_score.out`` in BSH with Q_S = 1 and ``antiquant_scale
    [2, Nkv * D]`` (K row, V row) in the query dtype, ``antiquant_mode=0`` (per channel): the docs' per-channel
    shape for BSH, where "Q_S为1时只支持per-channel"; vllm-ascend v0.11.0 runs the same layout and scale pair through
    ``npu_incre_flash_attention(..., input_layout='BSH', antiquant_scale=comb)`` (``w8a8.py:459-471``). Inside a
    captured graph the LSE buffer and the kernel's maximum workspace are made before the task, as for the window
    decode (:mod:`.window_decode_npu`).

``c8_paged_prefill`` -- any number of query tokens per request (prefill without cache, prefix-cache hits, chunked
    prefill, mixed batches, speculative verification), the contract of :data:`.paged_attention.PAGED_PREFILL` over
    int8 caches. NPU: ``npu_fused_infer_attention_score`` in TND (right-down causal ``sparse_mode=3``) with
    ``antiquant_scale [2, Nkv, D]`` in float16 (the docs: "Q_S大于等于2时只支持float16"; the per-channel shape of
    the token-major BSND layout, TND's nearest). vllm-ascend v0.11.0 has no such path (it raises
    ``NotImplementedError`` for PrefillCacheHit and for every other state); the TND antiquant shape is confirmable
    only on hardware (selftest row ``attention.c8_paged_prefill``).

Every state reads the int8 cache, including a prefill without cache (the step's tokens were just written): the
attention a prompt gets is then the same whether its prefix was a cache hit or not. vllm-ascend's PrefillNoCache
attends over the float K/V instead.

Reference twins: dequantize the requests' pages (only those: ``block_table[:, :ceil(max_len / block_size)]``) into a
compact float cache with a matching identity block table, then run the float twins of :mod:`.paged_attention`: the
plain fake-quant computation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm_npu.interface import Kernel, KernelContractError

from ._checks import need_mask, no_soft_cap
from .fia import antiquant, fia, fia_max_workspace, fia_out, gqa_paged_bsh, gqa_paged_tnd
from .paged_attention import paged_decode_reference, paged_prefill_reference

if TYPE_CHECKING:
    from .paged_attention import DecodePlan

#: The int8 range a C8 cache stores.
INT8_MIN, INT8_MAX = -128, 127


def quantize_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(round(x / scale), -128, 127)`` as int8; ``x [T, Nkv, D]``, ``scale [Nkv * D]`` (float32 maths)."""
    q = torch.round(x.float() / scale.float().view(x.shape[-2:]))
    return q.clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


def _check_scales(cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, name: str) -> None:
    nkv, d = cache.shape[-2:]
    if cache.dtype != torch.int8:
        raise KernelContractError(f"{name}: the C8 cache must be int8, got {cache.dtype}")
    if k_scale.numel() != nkv * d or v_scale.numel() != nkv * d:
        raise KernelContractError(
            f"{name}: per-channel scales need {nkv} x {d} = {nkv * d} values, got {k_scale.numel()} / {v_scale.numel()}"
        )


# --- the write ---------------------------------------------------------------------------------------------------


def c8_kv_write_npu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    import torch_npu

    t, nkv, d = key.shape
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.int64).view(-1, 1)
    indices = torch.cat((slots // block_size, slots % block_size), dim=1)
    for x, scale, cache in ((key, k_scale, key_cache), (value, v_scale, value_cache)):
        # div_mode=True takes float32 / bfloat16 scales (docs): the layer's are float32 already, a no-op then
        q = torch_npu.npu_quantize(x.reshape(t, nkv * d), scale.float(), None, torch.qint8, -1, True)
        torch_npu.npu_scatter_nd_update_(cache, indices, q.view(t, nkv, d))


def c8_kv_write_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    _check_scales(key_cache, k_scale, v_scale, "c8_kv_write")
    nkv, d = key_cache.shape[-2:]
    slots = slot_mapping.long()
    try:
        key_cache.view(-1, nkv, d).index_copy_(0, slots, quantize_reference(key, k_scale))
        value_cache.view(-1, nkv, d).index_copy_(0, slots, quantize_reference(value, v_scale))
    except IndexError as e:
        raise KernelContractError(
            f"c8_kv_write: {e}. Slots must be in [0, num_blocks * block_size) (padding redirected to the null block)"
        ) from e


C8_KV_WRITE = Kernel("c8_kv_write", npu=c8_kv_write_npu, reference=c8_kv_write_reference)


# --- dequantized pages (the reference) ------------------------------------------------------------------------------


def dequantized_pages(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    max_len: int,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pages of ``block_table``'s rows that hold up to ``max_len`` tokens, dequantized (``int8 * scale`` in
    float32, then ``dtype``) into a compact cache ``[B * nb, block_size, Nkv, D]``, with its block table ``[B, nb]``
    (row ``b`` -> pages ``b * nb .. b * nb + nb - 1``)."""
    batch = block_table.shape[0]
    block_size, nkv, d = key_cache.shape[1:]
    nb = max(1, -(-max_len // block_size))
    if nb > block_table.shape[1]:
        raise KernelContractError(
            f"C8 attention: {max_len} tokens need {nb} blocks, the block table has {block_table.shape[1]}"
        )
    pages = block_table[:, :nb].reshape(-1).long()
    shape = (batch * nb, block_size, nkv, d)
    k = (key_cache.index_select(0, pages).float() * k_scale.float().view(nkv, d)).to(dtype).view(shape)
    v = (value_cache.index_select(0, pages).float() * v_scale.float().view(nkv, d)).to(dtype).view(shape)
    table = torch.arange(batch * nb, device=block_table.device, dtype=block_table.dtype).view(batch, nb)
    return k, v, table


# --- decode ------------------------------------------------------------------------------------------------------


def c8_antiquant_scale(k_scale: torch.Tensor, v_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FIA's per-channel ``antiquant_scale``: ``[2, Nkv * D]`` (K row, V row) in ``dtype``."""
    return torch.stack((k_scale.reshape(-1), v_scale.reshape(-1))).to(dtype).contiguous()


def c8_paged_decode_scratch_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> dict[str, torch.Tensor]:
    """What a captured :func:`c8_paged_decode_npu` task needs allocated before its task group: the antiquant scale,
    the LSE buffer and the kernel's maximum workspace (the same arguments as the op)."""
    scales = c8_antiquant_scale(k_scale, v_scale, query.dtype)
    args = gqa_paged_bsh(
        query, key_cache, value_cache, block_table, context_lens, None,
        num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
    )  # fmt: skip
    return {
        "antiquant_scale": scales,
        "lse": query.new_empty(1),
        "workspace": fia_max_workspace(antiquant(args, scales)),
    }


def c8_paged_decode_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
    plan: DecodePlan | None = None,
    antiquant_scale: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> None:
    no_soft_cap(logits_soft_cap, "c8_paged_decode")
    scales = c8_antiquant_scale(k_scale, v_scale, query.dtype) if antiquant_scale is None else antiquant_scale
    args = gqa_paged_bsh(
        query, key_cache, value_cache, block_table, context_lens, None,
        num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
    )  # fmt: skip
    fia_out(antiquant(args, scales), out=out, lse=query.new_empty(1) if lse is None else lse, workspace=workspace)


def c8_paged_decode_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
    plan: DecodePlan | None = None,  # built for the int8 cache's block table: the compact one below has its own
    antiquant_scale: torch.Tensor | None = None,  # the NPU kernel's scratch; unused here
    lse: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> None:
    _check_scales(key_cache, k_scale, v_scale, "c8_paged_decode")
    if len(context_lens) == 0:
        return
    k, v, table = dequantized_pages(
        key_cache, value_cache, block_table, max(context_lens), k_scale, v_scale, query.dtype
    )
    paged_decode_reference(
        query, k, v, table, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale, out=out,
        logits_soft_cap=logits_soft_cap,
    )  # fmt: skip


C8_PAGED_DECODE = Kernel("c8_paged_decode", npu=c8_paged_decode_npu, reference=c8_paged_decode_reference)


# --- prefill over the cache ------------------------------------------------------------------------------------------


def c8_paged_prefill_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
) -> None:
    no_soft_cap(logits_soft_cap, "c8_paged_prefill")
    mask = need_mask(attn_mask, "c8_paged_prefill")
    nkv, d = key_cache.shape[-2:]
    # Q_S >= 2: the docs take float16 antiquant scales only; per channel, [2, Nkv, D] (token-major layout)
    scales = c8_antiquant_scale(k_scale, v_scale, torch.float16).view(2, nkv, d)
    args = gqa_paged_tnd(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, mask,
        sliding_window=None, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
    )  # fmt: skip
    out.copy_(fia(antiquant(args, scales)).view_as(out))


def c8_paged_prefill_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
) -> None:
    _check_scales(key_cache, k_scale, v_scale, "c8_paged_prefill")
    if len(seq_lens) == 0:
        return
    k, v, table = dequantized_pages(
        key_cache, value_cache, block_table[: len(seq_lens)], max(seq_lens), k_scale, v_scale, query.dtype
    )
    paged_prefill_reference(
        query, k, v, table, query_start_loc, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
        attn_mask=attn_mask, out=out, logits_soft_cap=logits_soft_cap,
    )  # fmt: skip


C8_PAGED_PREFILL = Kernel("c8_paged_prefill", npu=c8_paged_prefill_npu, reference=c8_paged_prefill_reference)
