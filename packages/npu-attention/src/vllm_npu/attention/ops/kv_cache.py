# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""KV-cache write ("reshape and cache"): new keys/values into the paged cache at their slots.

Contract (both twins):
    key, value   ``[T, Nkv, D]`` — the batch's real tokens (callers slice to ``num_actual_tokens``);
    key_cache, value_cache ``[num_blocks, block_size, Nkv, D]`` (contiguous), updated in place;
    slot_mapping ``[T]`` int32/int64, ``slot = block_id * block_size + offset``.
    ``key_cache.view(-1, Nkv, D)[slot_mapping[t]] = key[t]`` (same for value).

Padding slots (``-1``, vLLM's ``PAD_SLOT_ID``): vLLM pads ``slot_mapping`` only past ``num_actual_tokens`` (decode
context parallelism, which interleaves ``-1`` among real tokens, is rejected by the metadata builder); inside a
captured graph padded rows do reach the kernel. Neither twin is given a negative slot: the GQA metadata builder
redirects each padding slot to slot 0, inside vLLM's null block 0, which no request reads, on both backends
(vllm-ascend v0.11.0, whose captured graphs run this kernel on hardware, pads its slot buffer with 0,
``worker/model_runner_v1.py:1506``; the ATB docs say negative slots are skipped, torch_npu 2.8.0's say nothing, and
what has run wins). Both twins write every row; a negative slot given
to the reference twin is a :class:`~vllm_npu.interface.errors.KernelContractError`. Several rows on one slot (only
padding rows, on the null slot) leave one of them there, unspecified which.

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
from vllm_npu.interface import Kernel, KernelContractError


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
    slots = slot_mapping if slot_mapping.dtype == torch.long else slot_mapping.long()
    try:
        key_cache.view(-1, nkv, d).index_copy_(0, slots, key.to(key_cache.dtype))
        value_cache.view(-1, nkv, d).index_copy_(0, slots, value.to(value_cache.dtype))
    except IndexError as e:  # a negative or too-large slot (rows before it may already be written)
        raise KernelContractError(
            f"reshape_and_cache: {e}. The reference KV write takes only slots in [0, num_blocks * block_size): "
            "padding (-1) must be redirected to the null block first (the GQA metadata builder does)"
        ) from e


RESHAPE_AND_CACHE = Kernel("reshape_and_cache", npu=reshape_and_cache_npu, reference=reshape_and_cache_reference)
