"""KV-cache write ("reshape and cache"): new keys/values into the paged cache at their slots.

Contract (both twins):
    key, value   ``[T, Nkv, D]`` — the batch's real tokens (callers slice to ``num_actual_tokens``);
    key_cache, value_cache ``[num_blocks, block_size, Nkv, D]`` (contiguous), updated in place;
    slot_mapping ``[T]`` int32/int64, ``slot = block_id * block_size + offset``.
    ``key_cache.view(-1, Nkv, D)[slot_mapping[t]] = key[t]`` (same for value).

Padding slots (``-1``, vLLM's ``PAD_SLOT_ID``): vLLM pads ``slot_mapping`` only past ``num_actual_tokens`` (decode
context parallelism, which interleaves ``-1`` among real tokens, is rejected by the metadata builder), so the NPU path
never receives one after the caller's slice. The reference path skips any negative slot wherever it is.

NPU: ``torch_npu.npu_scatter_pa_kv_cache`` (documented in torch_npu 2.8.0, its "scenario 2": 3-D key/value and
``[num_blocks, block_size, Nkv, D]`` caches); it needs contiguous inputs and distinct slots in
``[0, num_blocks * block_size)``.
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

    torch_npu.npu_scatter_pa_kv_cache(
        key.contiguous(), value.contiguous(), key_cache, value_cache, slot_mapping
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
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    key_cache.view(-1, nkv, d).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, nkv, d).index_copy_(0, slots, value.to(value_cache.dtype))


RESHAPE_AND_CACHE = Kernel("reshape_and_cache", npu=reshape_and_cache_npu, reference=reshape_and_cache_reference)
