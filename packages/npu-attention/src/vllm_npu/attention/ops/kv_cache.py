# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""KV-cache write ("reshape and cache"): new keys/values into the paged cache at their slots.

Contract (both twins):
    key, value   ``[T, Nkv, D]`` — the batch's real tokens (callers slice to ``num_actual_tokens``);
    key_cache, value_cache ``[num_blocks, block_size, Nkv, D]`` (contiguous), updated in place;
    slot_mapping ``[T]`` int32/int64, ``slot = block_id * block_size + offset``.
    ``key_cache.view(-1, Nkv, D)[slot_mapping[t]] = key[t]`` (same for value).

Padding slots (``-1``, vLLM's ``PAD_SLOT_ID``): vLLM pads ``slot_mapping`` only past ``num_actual_tokens`` (decode
context parallelism, which interleaves ``-1`` among real tokens, is rejected by the metadata builder), so the NPU path
never receives one after the caller's slice. The reference path skips any negative slot wherever it is, without
reading device values back to the host (no data-dependent branch or shape).

NPU: ``torch_npu._npu_reshape_and_cache`` (ATB ReshapeAndCacheOperation), the write vllm-ascend v0.11.0 runs on A2/A3
(``attention/attention_v1.py:635-640``). Its binding picks the kernel's ND configuration for ND caches
(op-plugin 7.2.0 ``ReshapeAndCachAtb.cpp``: ``K_CACHE_V_CACHE`` unless both caches are FRACTAL_NZ); the ATB docs ask
for int32 slots (distinct, negative ones skipped) and key/value/caches of one dtype; the caches must be contiguous.
Not ``torch_npu.npu_scatter_pa_kv_cache``: its 2.8.0 binding hard-codes ``cacheMode="PA_NZ"``
(``ScatterPaKvCacheNpuOpApi.cpp``), whose kernel template rejects (or would write NZ-ordered data into) these ND
caches.
"""

from __future__ import annotations

import torch
from vllm_npu.interface.device import Kernel


def reshape_and_cache_npu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    import torch_npu

    # int32 slots (ATB's slotMapping dtype); vLLM hands int64 (vllm-ascend's runner keeps an int32 copy instead)
    slots = slot_mapping if slot_mapping.dtype == torch.int32 else slot_mapping.to(torch.int32)
    torch_npu._npu_reshape_and_cache(
        key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_indices=slots
    )


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    nkv, d = key_cache.shape[-2:]
    slots = slot_mapping.long()
    if slots.numel() == 0:
        return
    # No data-dependent branch or shape (those read device values back to the host, a sync per layer on an NPU):
    # every row is written, and each padding row is redirected to an "anchor" — the slot of a real row, rewritten
    # with that row's own key/value, or slot 0 rewritten with its current contents when the batch has no real row.
    # Duplicate indices in index_copy_ then all carry identical bits, so the result is deterministic and padding
    # changes nothing.
    keep = slots >= 0
    anchor = keep.to(torch.uint8).argmax(dim=0, keepdim=True)  # [1]: first real row (row 0 if none is real)
    anchor_is_real = keep.index_select(0, anchor)  # [1]
    anchor_slot = slots.index_select(0, anchor).clamp_min(0)  # [1]: its slot, or 0
    idx = torch.where(keep, slots, anchor_slot)
    row_keep = keep.view(-1, 1, 1)
    for src, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(-1, nkv, d)
        src = src.to(cache.dtype)
        anchor_row = torch.where(
            anchor_is_real.view(1, 1, 1), src.index_select(0, anchor), flat.index_select(0, anchor_slot)
        )  # [1, Nkv, D]
        flat.index_copy_(0, idx, torch.where(row_keep, src, anchor_row))


RESHAPE_AND_CACHE = Kernel("reshape_and_cache", npu=reshape_and_cache_npu, reference=reshape_and_cache_reference)
