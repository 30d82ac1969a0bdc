# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The GQA attention kernels of the Ascend 310P (Atlas 300I), each NPU call beside a twin that reads the NZ layout.

Layouts (:mod:`.nz`): caches ``[num_blocks, H / 16, block_size, 16]`` per K and V (``H = Nkv * D``); masks in NZ
tiles ``[*, S16 / 16, rows16, 16]``, float16, ``0`` = attend, ``-inf`` = hidden. The twins read every mask and cache
element through its NZ position, so a layout error (a transposed tile, a wrong block stride) changes their output.

``reshape_and_cache_nz`` — key/value ``[T, Nkv, D]`` into the NZ caches at ``slot_mapping [T]``:
    ``cache[s // bs, h // 16, s % bs, h % 16] = key[t].flatten()[h]``.
    NPU: ``torch_npu._npu_reshape_and_cache`` with int32 slots, the call vllm-ascend v0.11.0 makes on every chip
    (``attention/attention_v1.py:635-640``) with its 310P cache shape (``:72-74``).

``prefill_310p`` — first prefills (no cached context), causal:
    query/key/value/out ``[T16, N|Nkv, D]``: the batch's tokens zero-padded to a multiple of 16 (:func:`.nz.aligned_16`;
    the 310P flash kernel's token count, ATB docs ``_npu_flash_attention_v2`` constraint 4); seq_lens int32 host
    tensor ``[B]``; mask_nz ``[B, S16 / 16, S16, 16]``: the ``[S, S]`` causal mask (S = the batch's longest
    sequence: "mask大小必须使用真实的max_seq_len", constraint 2) in NZ, repeated per request.
    NPU: ``torch_npu._npu_flash_attention`` after ``npu_format_cast(mask, 29)``, as vllm-ascend v0.11.0 on 310P
    (``attention/attention_v1.py:347-366``).

``paged_decode_310p`` — one query token per request over the NZ caches:
    query/out ``[B, N, D]``; block_table ``[B, max_blocks]`` int32; seq_lens int32 device tensor ``[B]``.
    NPU: ``torch_npu._npu_paged_attention`` with the lengths on the device, as vllm-ascend v0.11.0 on 310P
    (``attention/attention_v1.py:403-406, 471-480``).

``paged_splitfuse_310p`` — any other step (chunked prefill, prefix hits, decodes mixed with prefills):
    query/out ``[T, N, D]``; query_lens int32 host tensor ``[B]``; seq_lens int32 device tensor ``[B]``; mask_nz
    ``[1, S16 / 16, T16, 16]``: row ``t`` is the causal mask's row at token ``t``'s position (columns up to the
    longest sequence S), in NZ.
    NPU: ``torch_npu._npu_paged_attention_splitfuse`` after ``npu_format_cast(mask, 29)``: vllm-ascend v0.10.0rc1
    (its 310P stable release, ``docs/source/faqs.md``) on 310P (``attention/attention_v1.py:411-431``, mask from
    ``attention/attention_mask.py`` ``get_splitfuse_attn_mask`` and ``utils.py`` ``nd_to_nz_spec``). Not v0.11.0's
    ``npu_fused_infer_attention_score`` (``_forward_v1_style``): torch_npu 2.8.0 documents it for A2/A3 only, and
    v0.11.0 unpacks the 310P cache's shape as ``(num_block, block_size, _, _)``, so it would pass ``H / 16`` as the
    block size.
"""

from __future__ import annotations

import torch
from vllm_npu.interface import Kernel, KernelContractError

from ._reference import attend
from .kv_cache import reshape_and_cache_npu
from .nz import ACL_FORMAT_FRACTAL_NZ, nz_cache_sequence, nz_to_nd, round_up_16

# --- KV write into the NZ cache -----------------------------------------------------------------------------------


def reshape_and_cache_nz_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    nb, tiles, bs, tile = key_cache.shape
    slots = slot_mapping.long()
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= nb * bs):
        raise KernelContractError(
            f"reshape_and_cache_nz: slots must lie in [0, {nb * bs}); padding (-1) must be redirected to the null "
            "block first (the GQA metadata builder does)"
        )
    t = key.shape[0]
    if t and key[0].numel() != tiles * tile:
        raise KernelContractError(
            f"reshape_and_cache_nz: a token's {key[0].numel()} key values do not fill {tiles} NZ tiles of {tile}"
        )
    blocks, offsets = slots // bs, slots % bs
    # [nb, bs, H / 16, 16] views of the caches: token (block, offset)'s tiles, written through to the NZ storage.
    key_cache.permute(0, 2, 1, 3)[blocks, offsets] = key.reshape(t, tiles, tile).to(key_cache.dtype)
    value_cache.permute(0, 2, 1, 3)[blocks, offsets] = value.reshape(t, tiles, tile).to(value_cache.dtype)


RESHAPE_AND_CACHE_NZ = Kernel(
    "reshape_and_cache_nz", npu=reshape_and_cache_npu, reference=reshape_and_cache_nz_reference
)


def _allowed(mask_rows: torch.Tensor) -> torch.Tensor:
    """Attend where the float mask is 0 (hidden entries are ``-inf`` in float16)."""
    return mask_rows == 0


# --- first prefill ------------------------------------------------------------------------------------------------


def prefill_310p_npu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    mask_nz: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    import torch_npu

    mask = torch_npu.npu_format_cast(mask_nz.contiguous(), ACL_FORMAT_FRACTAL_NZ)
    torch_npu._npu_flash_attention(
        query=query,
        key=key,
        value=value,
        mask=mask,
        seq_len=seq_lens,
        scale_value=scale,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        out=out,
    )


def prefill_310p_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    mask_nz: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    lens = [int(n) for n in seq_lens.tolist()]
    total = sum(lens)
    if query.shape[0] != round_up_16(total) or out.shape[0] != query.shape[0] or key.shape[0] != query.shape[0]:
        raise KernelContractError(
            f"prefill_310p: query/key/value/out must hold the batch's {total} tokens padded to {round_up_16(total)} "
            f"(aligned_16), got {query.shape[0]}, {key.shape[0]}, {out.shape[0]}"
        )
    s = max(lens, default=0)
    if mask_nz.shape[0] != len(lens) or mask_nz.shape[-2] != round_up_16(s):
        raise KernelContractError(
            f"prefill_310p: the NZ mask must be the [{s}, {s}] causal mask repeated per request "
            f"({len(lens)} x [{round_up_16(s) // 16}, {round_up_16(s)}, 16]), got {tuple(mask_nz.shape)}"
        )
    masks = nz_to_nd(mask_nz)  # [B, S16, S16]
    start = 0
    for i, n in enumerate(lens):
        if n:
            rows = slice(start, start + n)
            o = attend(query[rows], key[rows], value[rows], _allowed(masks[i, :n, :n]), scale)
            out[rows] = o.to(out.dtype)
        start += n


PREFILL_310P = Kernel("prefill_310p", npu=prefill_310p_npu, reference=prefill_310p_reference)


# --- decode over the NZ cache -------------------------------------------------------------------------------------


def paged_decode_310p_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    import torch_npu

    torch_npu._npu_paged_attention(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        num_kv_heads=num_kv_heads,
        num_heads=num_heads,
        scale_value=scale,
        block_table=block_table,
        context_lens=seq_lens.to(query.device),
        out=out,
    )


def paged_decode_310p_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    d = query.shape[-1]
    for b, n in enumerate(seq_lens.tolist()):
        k = nz_cache_sequence(key_cache, block_table[b], n, d)
        v = nz_cache_sequence(value_cache, block_table[b], n, d)
        out[b : b + 1] = attend(query[b : b + 1], k, v, None, scale).to(out.dtype)


PAGED_DECODE_310P = Kernel("paged_decode_310p", npu=paged_decode_310p_npu, reference=paged_decode_310p_reference)


# --- chunked prefill / prefix hits / mixed steps ------------------------------------------------------------------


def paged_splitfuse_310p_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    mask_nz: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    import torch_npu

    mask = torch_npu.npu_format_cast(mask_nz.contiguous(), ACL_FORMAT_FRACTAL_NZ)
    torch_npu._npu_paged_attention_splitfuse(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        mask=mask,
        block_table=block_table,
        seq_len=query_lens,
        context_lens=seq_lens.to(query.device),
        num_kv_heads=num_kv_heads,
        num_heads=num_heads,
        scale_value=scale,
        out=out,
    )


def paged_splitfuse_310p_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    mask_nz: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    qlens, lens = [int(n) for n in query_lens.tolist()], [int(n) for n in seq_lens.tolist()]
    total, s = sum(qlens), max(lens, default=0)
    if query.shape[0] != total or mask_nz.shape[0] != 1 or mask_nz.shape[-2] != round_up_16(total):
        raise KernelContractError(
            f"paged_splitfuse_310p: {total} query tokens need an NZ mask [1, {round_up_16(s) // 16}, "
            f"{round_up_16(total)}, 16], got query {tuple(query.shape)} and mask {tuple(mask_nz.shape)}"
        )
    rows = nz_to_nd(mask_nz)[0]  # [T16, S16]
    d = query.shape[-1]
    start = 0
    for b, (q, n) in enumerate(zip(qlens, lens)):
        if q:
            k = nz_cache_sequence(key_cache, block_table[b], n, d)
            v = nz_cache_sequence(value_cache, block_table[b], n, d)
            sel = slice(start, start + q)
            out[sel] = attend(query[sel], k, v, _allowed(rows[sel, :n]), scale).to(out.dtype)
        start += q


PAGED_SPLITFUSE_310P = Kernel(
    "paged_splitfuse_310p", npu=paged_splitfuse_310p_npu, reference=paged_splitfuse_310p_reference
)
