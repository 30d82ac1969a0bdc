# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The DeepSeek-V3.2 indexer on Ascend: its key cache backend, the lightning indexer and the model-dtype
``Indexer.forward`` (:mod:`.sfa` is the sparse attention that reads the indexer's selection).

vLLM's own indexer path is CUDA-only (fp8 keys, DeepGEMM logits, ``topk_indices_buffer`` allocated on "cuda",
``DeepseekV32IndexerBackend``'s builder queries CUDA device properties). On Ascend the indexer keys stay in the model
dtype, so a DeepSeek-V3.2 model override (npu-models) must: allocate ``topk_indices_buffer`` on the current device,
give each ``Indexer`` a key cache layer in the model dtype (``[nb, bs, index_head_dim]``, served by
:class:`AscendSFAIndexerBackend`) and run :func:`ascend_indexer_forward` (ending in :class:`AscendLightningIndexer`)
instead of ``Indexer.forward``. This module provides those pieces; it never reaches into the model itself.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.attention.backends.abstract import AttentionBackend
from vllm_npu.interface import ConfigError, KernelContractError

from ..ops.sfa_kernels import INDEXER_CACHE_WRITE, LIGHTNING_INDEXER
from .sfa import AscendSFAMetadata, AscendSFAMetadataBuilder

# --- the indexer's key cache and top-k selection ------------------------------------------------------------------


class AscendSFAIndexerBackend(AttentionBackend):
    """Backend of the indexer key-cache layer: one ``index_head_dim`` key per token, ``[nb, bs, D]``, model dtype.
    It has no attention impl of its own; :class:`AscendLightningIndexer` reads and writes the cache."""

    @staticmethod
    def get_name() -> str:
        return "ASCEND_SFA_INDEXER"

    @staticmethod
    def get_impl_cls() -> type:
        raise NotImplementedError("the indexer cache layer has no attention impl; use AscendLightningIndexer")

    @staticmethod
    def get_metadata_cls() -> type[AscendSFAMetadata]:  # type: ignore[override]  # as AscendMLABackend's
        return AscendSFAMetadata

    @staticmethod
    def get_builder_cls() -> type[AscendSFAMetadataBuilder]:
        return AscendSFAMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        if num_kv_heads != 1:
            raise KernelContractError(f"the indexer caches one key per token (num_kv_heads=1), got {num_kv_heads}")
        return (num_blocks, block_size, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        return (0, 1, 2)


class AscendLightningIndexer:
    """The per-step indexer work that replaces vLLM's CUDA ``sparse_attn_indexer`` op on Ascend.

    Built once per indexer layer (kernels chosen here). Call it with the layer's index queries ``q [T, H, D]``
    (rope applied), keys ``k [T, D]`` (normed, rope applied), per-head ``weights [T, H]`` (``weights_proj`` output
    times ``softmax_scale * H**-0.5``), the indexer cache ``[nb, bs, D]`` and the cache layer's
    :class:`AscendSFAMetadata` (None in the profile run). It writes the new keys, selects the top-k cached tokens of
    every query token and stores them in ``topk_indices_buffer[:T]`` (``-1`` padded), which it returns.
    """

    def __init__(self, topk_tokens: int) -> None:
        if topk_tokens <= 0:
            raise ConfigError(f"index_topk must be positive, got {topk_tokens}")
        self.topk_tokens = topk_tokens
        self._write = INDEXER_CACHE_WRITE.select()
        self._select = LIGHTNING_INDEXER.select()

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AscendSFAMetadata | None,
        topk_indices_buffer: torch.Tensor,
    ) -> torch.Tensor:
        if attn_metadata is None:
            return topk_indices_buffer
        if topk_indices_buffer.shape[1] != self.topk_tokens:
            raise KernelContractError(
                f"topk_indices_buffer has {topk_indices_buffer.shape[1]} columns, index_topk is {self.topk_tokens}"
            )
        n = attn_metadata.num_actual_tokens
        self._write(k[:n], kv_cache, attn_metadata.slot_mapping[:n])
        topk_indices_buffer[:n] = self._select(
            q[:n], weights[:n], kv_cache, attn_metadata.block_table,
            attn_metadata.query_start_loc_list, attn_metadata.seq_lens_list, self.topk_tokens,
        )  # fmt: skip
        return topk_indices_buffer


# --- model-side pieces for a DeepSeek-V3.2 override (npu-models wires them in; see the module docstring) ----------


def ascend_indexer_forward(
    indexer: Any,
    hidden_states: torch.Tensor,
    qr: torch.Tensor,
    positions: torch.Tensor,
    rotary_emb: Any,
    lightning: AscendLightningIndexer,
) -> torch.Tensor:
    """vLLM 0.11's ``Indexer.forward`` in the model dtype (no fp8), ending in :class:`AscendLightningIndexer`.

    Uses the indexer's own modules and fields exactly as vLLM does (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``,
    ``n_head``, ``head_dim``, ``rope_dim`` with the rope channels first, ``softmax_scale``, ``k_cache`` -- a
    cache layer with ``prefix`` and ``kv_cache`` -- and ``topk_indices_buffer``). Returns the filled ``topk_indices_buffer``.
    """
    from vllm.forward_context import get_forward_context

    q = indexer.wq_b(qr)[0].view(-1, indexer.n_head, indexer.head_dim)
    q_pe, q_nope = torch.split(q, [indexer.rope_dim, indexer.head_dim - indexer.rope_dim], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)[0])
    k_pe, k_nope = torch.split(k, [indexer.rope_dim, indexer.head_dim - indexer.rope_dim], dim=-1)
    q_pe, k_pe = rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
    q = torch.cat([q_pe, q_nope], dim=-1)
    k = torch.cat([k_pe.squeeze(1), k_nope], dim=-1)
    weights = indexer.weights_proj(hidden_states)[0] * (indexer.softmax_scale * indexer.n_head**-0.5)

    # vLLM types attn_metadata with v0's marker class (see AscendMLABackend.get_metadata_cls): it is the cache
    # layer's AscendSFAMetadata (or None in the profile run), which the indexer takes as it comes.
    metadata: Any = get_forward_context().attn_metadata
    meta = metadata.get(indexer.k_cache.prefix) if isinstance(metadata, dict) else metadata
    return lightning(q, k, weights, indexer.k_cache.kv_cache[0], meta, indexer.topk_indices_buffer)
