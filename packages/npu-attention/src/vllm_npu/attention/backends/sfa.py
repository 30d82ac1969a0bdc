# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""AscendSFABackend: DeepSeek-V3.2 sparse MLA attention over the tokens the layer's indexer selected.

How vLLM 0.11 drives it (``vllm/model_executor/models/deepseek_v2.py``, ``vllm/model_executor/layers/mla.py``):

- a config with ``index_topk`` makes every ``DeepseekV2MLAAttention`` build an ``Indexer`` and pass
  ``is_sparse=True``; ``MultiHeadLatentAttention`` then creates its ``Attention(use_mla=True, use_sparse=True,
  indexer=...)``, so the platform's ``get_attn_backend_cls(use_sparse=True)`` selects :class:`AscendSFABackend` and the
  impl receives the ``indexer`` module;
- each step ``MultiHeadLatentAttention.forward`` first calls ``indexer(hidden_states, q_c, positions, rotary_emb)``,
  which fills ``indexer.topk_indices_buffer [max_num_batched_tokens, index_topk]`` (int32 request-local positions,
  ``-1`` = none) for the step's tokens, then calls the attention layer; the sparse impl reads that buffer
  (as vLLM's ``FlashMLASparseImpl`` does);
- the indexer keys live in their own cache layer (``Indexer.k_cache``, a ``DeepseekV32IndexerCache``): one vector of
  ``index_head_dim`` per token, with its own KV spec and backend.

The indexer side on Ascend (its key cache backend, the lightning indexer, the model-dtype ``Indexer.forward``) is
:mod:`.sfa_indexer`; both sides share :class:`AscendSFAMetadata` and its builder, defined here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.attention.backends.abstract import AttentionLayer
from vllm.v1.attention.backends.mla.common import MLACommonBaseImpl
from vllm.v1.attention.backends.utils import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm_npu.interface import ConfigError, KernelContractError

from ..ops.mla_cache import MLA_CACHE_WRITE, latent_cache_planes
from ..ops.sfa_kernels import SPARSE_MLA_ATTENTION
from ..ops.weight_format import kv_b_proj_to_nd
from .mla import AscendMLABackend


@dataclass
class AscendSFAMetadata:
    """Per-step metadata of the sparse attention layers and of the indexer cache layer (same fields)."""

    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [B + 1] device
    slot_mapping: torch.Tensor  # [T] device
    block_table: torch.Tensor  # [B, max_blocks] int32
    query_start_loc_list: list[int]  # host copies: the kernels take lists / build their own tensors
    seq_lens_list: list[int]


class AscendSFAMetadataBuilder(AttentionMetadataBuilder[AscendSFAMetadata]):
    """No decode/prefill split: sparse attention treats every token alike (top-k keys each)."""

    # No full graphs (PIECEWISE works; vLLM downgrades FULL_DECODE_ONLY to eager and logs why). The indexer's top-k
    # selection and the sparse kernel take per-step host lists (query starts, sequence lengths), and the NPU has no
    # graph-task update for them to follow: vllm-ascend v0.11.0's SFA builder is NEVER too (sfa_v1.py
    # aclgraph_support), its full-graph DeepSeek-V3.2 path being torchair (torchair_sfa.py), and its ACL graph task
    # updates (compilation/acl_graph.py) cover only npu_fused_infer_attention_score and _npu_paged_attention, not
    # the custom npu_sparse_flash_attention / npu_lightning_indexer ops.
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    _cudagraph_support: ClassVar[AttentionCGSupport] = cudagraph_support  # vLLM 0.11.1's name for it
    reorder_batch_threshold: int | None = None

    # Not a no-op: vLLM declares AttentionMetadataBuilder.__init__ abstract, so a builder must define its own.
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> AscendSFAMetadata:
        m = common_attn_metadata
        return AscendSFAMetadata(
            num_reqs=m.num_reqs,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc,
            slot_mapping=m.slot_mapping,
            block_table=m.block_table_tensor[: m.num_reqs],
            query_start_loc_list=m.query_start_loc_cpu[: m.num_reqs + 1].tolist(),
            seq_lens_list=m.seq_lens_cpu[: m.num_reqs].tolist(),
        )


class AscendSFABackend(AscendMLABackend):
    """Same latent cache as :class:`AscendMLABackend`; attention restricted to the indexer's top-k tokens."""

    @staticmethod
    def get_name() -> str:
        return "ASCEND_SFA"

    # A subclass for the MLA latent-cache layout only: metadata, builder and impl are SFA's own (and see
    # AscendMLABackend.get_metadata_cls on vLLM's metadata type).
    @staticmethod
    def get_metadata_cls() -> type[AscendSFAMetadata]:  # type: ignore[override]
        return AscendSFAMetadata

    @staticmethod
    def get_builder_cls() -> type[AscendSFAMetadataBuilder]:  # type: ignore[override]
        return AscendSFAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AscendSFAImpl]:  # type: ignore[override]
        return AscendSFAImpl


class AscendSFAImpl(MLACommonBaseImpl[AscendSFAMetadata]):
    """Sparse MLA: absorbed (latent-space) MQA of every token over the cached tokens its indexer picked.

    Inputs as for MLA (``q [T, N, P + R]``, ``k_c_normed [T, L]``, ``k_pe [T, 1, R]``); the selection comes from
    ``indexer.topk_indices_buffer[:T]``, filled earlier in the same layer forward. Output ``[T, N * V]``.

    Writes every element of ``output`` on every call (zeros on the profile run and in the padded rows past
    ``num_actual_tokens``), so vLLM's attention layer may hand it an uninitialised buffer (npu-patches'
    ``attention-output-empty`` reads it: the :class:`~vllm_npu.interface.protocols.OutputBufferFiller` contract).
    """

    fills_output_buffer: ClassVar[bool] = True

    def __init__(self, *args: Any, indexer: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "indexer": indexer})
        if indexer is None or getattr(indexer, "topk_indices_buffer", None) is None:
            raise ConfigError(
                "AscendSFABackend serves sparse (DeepSeek-V3.2) attention layers only: the layer must pass its "
                "indexer (with topk_indices_buffer); a dense MLA model should select AscendMLABackend"
            )
        if self.kv_cache_dtype not in ("auto", None):
            raise ConfigError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported by AscendSFABackend; use 'auto'"
            )
        self._write = MLA_CACHE_WRITE.select()
        self._sparse = SPARSE_MLA_ATTENTION.select()

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        kv_b_proj_to_nd(self.kv_b_proj)  # vLLM's split below reshapes the weight: it must be ND, not FRACTAL_NZ
        super().process_weights_after_loading(act_dtype)

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AscendSFAMetadata | None,  # None on vLLM's profile run
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output is None:
            raise KernelContractError("AscendSFAImpl.forward needs the output buffer (accept_output_buffer=True)")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by AscendSFABackend")
        if attn_metadata is None:  # profile run
            return output.fill_(0)

        n = attn_metadata.num_actual_tokens
        q = q[:n]
        nope, rope = latent_cache_planes(kv_cache, self.kv_lora_rank, self.qk_rope_head_dim)
        self._write(k_c_normed[:n], k_pe[:n].reshape(n, -1), nope, rope, attn_metadata.slot_mapping[:n])

        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        ql_nope = torch.bmm(q_nope.transpose(0, 1), self.W_UK_T).transpose(0, 1)  # [T, N, L]
        topk = self.indexer.topk_indices_buffer[:n]
        latent = self._sparse(
            ql_nope, q_pe, nope, rope, topk, attn_metadata.block_table,
            attn_metadata.query_start_loc_list, attn_metadata.seq_lens_list, self.scale,
        )  # fmt: skip
        out = torch.bmm(latent.transpose(0, 1), self.W_UV).transpose(0, 1)  # [T, N, V]
        output[:n] = out.reshape(n, -1).to(output.dtype)
        output[n:].zero_()  # padded rows (graph-size padding): the buffer may be uninitialised
        return output
