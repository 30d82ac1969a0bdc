# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The GQA backend's decoder forward on an Ascend 310P (Atlas 300I): NZ KV cache, NZ masks, 16-aligned prefill.

Kernel per step (:mod:`..ops.attention_310p`; the cache ``[2, num_blocks, Nkv * D / 16, block_size, 16]``):

==================================  ===============================================================================
every step (fresh K/V)              ``reshape_and_cache_nz`` into the NZ caches
PrefillNoCache                      ``prefill_310p``: q/k/v/out padded to 16 tokens, the causal mask in NZ per request
DecodeOnly                          ``paged_decode_310p`` over the NZ caches, lengths on the device
every other state                   ``paged_splitfuse_310p`` with the step's NZ splitfuse mask
==================================  ===============================================================================

The 310P runs eagerly (no graphs: ``vllm_npu.platform._chip_gate``), so nothing here is captured. Sliding-window
layers are refused when built: the window kernels are A2/A3 fused-infer-attention calls.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm_npu.interface import ConfigError, kernel_backend

from ..metadata import AscendAttentionState, AscendMetadata
from ..ops.attention_310p import PAGED_DECODE_310P, PAGED_SPLITFUSE_310P, PREFILL_310P, RESHAPE_AND_CACHE_NZ
from ..ops.nz import aligned_16


class Kernels310P:
    """The 310P kernels of one layer, picked when it is built (the NPU calls, or their NZ-reading twins)."""

    def __init__(self, sliding_window: int | None) -> None:
        if sliding_window is not None:
            raise ConfigError(
                f"sliding-window attention (window {sliding_window}) is not supported on the Atlas 300I (Ascend "
                "310P): its kernels (npu_fused_infer_attention_score) are documented for A2/A3 only; serve a model "
                "without a sliding window"
            )
        backend = kernel_backend()
        self.reshape_and_cache = RESHAPE_AND_CACHE_NZ.select(backend)
        self.prefill = PREFILL_310P.select(backend)
        self.paged_decode = PAGED_DECODE_310P.select(backend)
        self.paged_splitfuse = PAGED_SPLITFUSE_310P.select(backend)


def forward_310p(
    kernels: Kernels310P,
    md: AscendMetadata,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    heads: dict[str, Any],
    write_kv: bool,
) -> None:
    """One decoder layer's attention of the step ``md`` on a 310P: ``query``/``out`` ``[n, N, D]`` (the step's
    ``num_actual_tokens`` rows), ``key``/``value`` ``[n, Nkv, D]`` or None (a layer sharing another's cache)."""
    n = md.num_actual_tokens
    key_cache, value_cache = kv_cache.unbind(0)
    if write_kv and key is not None and value is not None:
        kernels.reshape_and_cache(key, value, key_cache, value_cache, md.slot_mapping[:n])
    kw = {"num_heads": heads["num_heads"], "num_kv_heads": heads["num_kv_heads"], "scale": heads["scale"]}
    state = md.attn_state
    if state is AscendAttentionState.DecodeOnly:
        kernels.paged_decode(query, key_cache, value_cache, md.block_table, md.seq_lens, out=out, **kw)
        return
    if md.nz_mask is None:
        raise ValueError("the 310P attention needs the metadata's NZ mask (built by the metadata builder on a 310P)")
    if state is AscendAttentionState.PrefillNoCache and key is not None and value is not None:
        out16 = aligned_16(out)
        kernels.prefill(
            aligned_16(query),
            aligned_16(key),
            aligned_16(value.contiguous()),
            torch.tensor(md.seq_lens_list, dtype=torch.int32),
            mask_nz=md.nz_mask.repeat(md.num_reqs, 1, 1, 1),
            out=out16,
            **kw,
        )
        if out16 is not out:
            out.copy_(out16[:n])
        return
    qsl = md.query_start_loc_list
    query_lens = torch.tensor([b - a for a, b in zip(qsl, qsl[1:])], dtype=torch.int32)
    kernels.paged_splitfuse(
        query, key_cache, value_cache, md.block_table, query_lens, md.seq_lens, mask_nz=md.nz_mask, out=out, **kw
    )
