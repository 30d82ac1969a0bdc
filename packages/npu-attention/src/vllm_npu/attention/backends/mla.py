# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""AscendMLABackend: Multi-head Latent Attention (DeepSeek-V2/V3) on the paged latent KV cache.

Built on vLLM 0.11's MLA seams: the backend subclasses ``MLACommonBackend`` (cache shape, spec), the impl subclasses
``MLACommonBaseImpl`` (its ``process_weights_after_loading`` splits ``kv_b_proj`` into ``W_UK_T [N, P, L]`` and
``W_UV [N, L, V]``) and overrides the attention itself with our kernels; the metadata builder reads only
``CommonAttentionMetadata`` and the vLLM config, never the model (a builder that reads the model's rotary caches
fails on MLA models whose rotary embedding has none, vllm-ascend#5385).

Per step (decodes first: ``reorder_batch_threshold = 1``, or ``1 + k`` with ``k`` speculative tokens, so a
verification step's requests of up to ``1 + k`` tokens are decodes):

- the layer's new latent ``kv_c`` and rotated ``k_pe`` go to the cache (:data:`~..ops.mla_cache.MLA_CACHE_WRITE`);
- decode tokens: absorbed attention over the latent cache (``q_nope @ W_UK`` then MQA with head size ``L + R``,
  then ``W_UV``; :data:`~..ops.mla_attention.MLA_DECODE`, or :data:`~..ops.mla_attention.MLA_SPEC_DECODE` when a
  decode request carries several tokens: causal inside its draft window);
- prefill tokens: compute-friendly attention: the new tokens attend causally to themselves (``kv_b_proj`` up-projects
  their latents), then the prior context is loaded from the cache chunk by chunk (a bounded workspace,
  :data:`~..ops.mla_cache.PAGED_CACHE_LOAD`), up-projected, and merged with a running log-sum-exp
  (:data:`~..ops.mla_attention.RING_MLA`).

A decode step inside a compiled decode graph (``npu.graph_mode='torchair'``: the platform then answers
``opaque_attention_op()`` False, so vLLM's attention layer calls this impl directly and Dynamo traces it) hands the
layer graph inputs instead (:meth:`AscendMLAMetadata.graph_inputs`, through
:func:`vllm_npu.interface.graphs.compiled_step_inputs`): every row of the padded batch is written to the latent
planes (:data:`~..ops.graph_decode.GRAPH_KV_WRITE`) and attended by the absorbed decode
(:data:`~..ops.graph_decode.MLA_GRAPH_DECODE`), from those tensors and the shapes only.

Kernels are chosen once per impl (``Kernel.select()``): torch_npu on an NPU, the references on the emulated device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
from vllm.attention.backends.abstract import AttentionLayer
from vllm.v1.attention.backends.mla.common import (
    MLACommonBackend,
    MLACommonBaseImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.v1.attention.backends.utils import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    split_decodes_and_prefills,
)
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm_npu.interface import (
    ConfigError,
    KernelContractError,
    Refresh,
    active_recorder,
    compiled_step_inputs,
    kernel_backend,
    launch,
)

from ..masks import AttentionMaskBuilder
from ..metadata import MAX_DECODE_THRESHOLD, GraphDecodeInputs, reject_decode_context_parallel
from ..ops.graph_decode import GRAPH_KV_WRITE, MLA_GRAPH_DECODE
from ..ops.mla_attention import MLA_DECODE, MLA_SPEC_DECODE, RING_MLA, mla_decode_workspace_npu, ring_mla_mask
from ..ops.mla_cache import MLA_CACHE_WRITE, PAGED_CACHE_LOAD, deinterleave, latent_cache_planes
from ..ops.weight_format import kv_b_proj_to_nd


class AscendMLABackend(MLACommonBackend):
    accept_output_buffer: bool = True

    @staticmethod
    def get_name() -> str:
        return "ASCEND_MLA"

    # vLLM types these with v0's AttentionMetadata marker class, which no v1 metadata class subclasses (its own FlashAttentionMetadata and MLACommonMetadata included).
    @staticmethod
    def get_metadata_cls() -> type[AscendMLAMetadata]:  # type: ignore[override]
        return AscendMLAMetadata

    # MLACommonBackend is our base for its latent-cache layout and head sizes; its CUDA metadata builder is not ours.
    @staticmethod
    def get_builder_cls() -> type[AscendMLAMetadataBuilder]:  # type: ignore[override]
        return AscendMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AscendMLAImpl]:
        return AscendMLAImpl

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """``[num_blocks, block_size, L + R]``: vLLM's MLA page size; the impl splits it into the nope and rope planes
        (:func:`~vllm_npu.attention.ops.mla_cache.latent_cache_planes`)."""
        if num_kv_heads != 1:
            raise KernelContractError(f"MLA caches one latent vector per token (num_kv_heads=1), got {num_kv_heads}")
        if cache_dtype_str not in ("auto", None):
            raise ConfigError(f"kv_cache_dtype={cache_dtype_str!r} is not supported by AscendMLABackend; use 'auto'")
        return (num_blocks, block_size, head_size)

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any kv_lora_rank + rope dim on the reference; the NPU kernels check their own limits

    @classmethod
    def validate_head_size(cls, head_size: int) -> None:
        if head_size <= 0:
            raise ConfigError(f"MLA head size (kv_lora_rank + qk_rope_head_dim) must be positive, got {head_size}")


# --- metadata ---------------------------------------------------------------------------------------------------


@dataclass
class AscendMLADecodeMetadata:
    block_table: torch.Tensor  # [num_decodes, max_blocks] int32
    seq_lens: torch.Tensor  # [num_decodes] device
    seq_lens_list: list[int]  # the same on the host (the NPU kernel takes a list)
    # Speculative decoding: query tokens per decode request (1 + accepted-so-far drafts, mixed), on the host.
    query_lens: list[int] = field(default_factory=list)
    max_query_len: int = 1
    # The multi-token NPU kernel's 2048 splitfuse mask (None on the reference backend and for one-token decodes).
    attn_mask: torch.Tensor | None = None


@dataclass
class AscendMLAContextChunk:
    """One chunk of prior context: for prefill request ``i``, cached positions ``[starts[i], starts[i] + lens[i])``."""

    starts: torch.Tensor  # [num_prefills] int32, device
    lens: torch.Tensor  # [num_prefills] int32, device
    lens_list: list[int]
    total: int


@dataclass
class AscendMLAPrefillMetadata:
    block_table: torch.Tensor  # [num_prefills, max_blocks]
    query_start_loc: torch.Tensor  # [num_prefills + 1], relative to the first prefill token
    max_query_len: int
    query_lens: list[int]
    context_lens: list[int]
    context_chunks: list[AscendMLAContextChunk] = field(default_factory=list)


@dataclass
# Our decode part replaces vLLM's CUDA one (other fields), which the type parameter's bound names.
class AscendMLAMetadata(MLACommonMetadata[AscendMLADecodeMetadata]):  # type: ignore[type-var]
    """vLLM's MLA metadata with our decode/prefill parts. ``head_dim`` stays None: vLLM's check only knows 576."""

    prefill: AscendMLAPrefillMetadata | None = None  # type: ignore[assignment]
    capture: bool = False  # vLLM's dummy batch of a graph capture (build_for_cudagraph_capture)

    def graph_inputs(self, batch_size: int) -> GraphDecodeInputs | None:
        """This pure-decode step laid out as the inputs of a compiled decode graph of ``batch_size`` rows
        (:class:`~vllm_npu.interface.protocols.GraphInputsProvider`; the torchair wrapper calls it): block table,
        sequence lengths and latent-cache slots of the padded batch, padding rows on vLLM's null block
        (:class:`~vllm_npu.attention.metadata.GraphDecodeInputs`). One row per request when every request has one
        token; one row per token (:meth:`GraphDecodeInputs.per_token`) in a speculative verification step (None:
        run the step eagerly)."""
        d, n = self.decode, self.num_reqs
        if self.prefill is not None or d is None or self.num_actual_tokens > batch_size:
            raise ValueError(
                f"a compiled MLA decode graph of {batch_size} rows takes a pure-decode step of at most "
                f"{batch_size} tokens, got {self.num_decodes} decode and {self.num_prefills} prefill "
                f"requests with {self.num_actual_tokens} tokens"
            )
        if d.max_query_len == 1 and self.num_actual_tokens == n:
            return GraphDecodeInputs.padded(
                d.block_table, d.seq_lens, d.seq_lens_list, self.slot_mapping, n, batch_size
            )
        return GraphDecodeInputs.per_token(
            d.block_table, d.seq_lens_list, d.query_lens, self.slot_mapping, batch_size, self.capture
        )


class AscendMLAMetadataBuilder(AttentionMetadataBuilder[AscendMLAMetadata]):
    """Splits the (reordered) batch into decodes and prefills and plans the context chunks of each prefill.

    Context chunks: each prefill request with cached context gets an equal share of a token budget per chunk
    (vLLM's ``determine_chunked_prefill_workspace_size``), rounded down to whole blocks so chunk starts are
    block-aligned (never less than one block per request). Set :attr:`context_chunk_tokens` to change the budget.

    Speculative decoding: ``reorder_batch_threshold = 1 + num_speculative_tokens`` (at most 16, the NPU kernel's
    query limit), so verification steps (and drafting steps of an EAGLE/MTP head) run as decodes with several query
    tokens per request; the decode part then carries each request's query length.
    """

    # Full graphs for pure-decode batches (FULL_DECODE_ONLY): the decode kernel is an updatable task whose sequence
    # lengths are refreshed before every replay; block tables and slot mappings are views of vLLM's persistent
    # buffers. Prefill kernels take per-request host lists (query/context lengths, chunk plans) no update follows.
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    _cudagraph_support: ClassVar[AttentionCGSupport] = cudagraph_support  # vLLM 0.11.1's name for it
    reorder_batch_threshold: int = 1

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        reject_decode_context_parallel(vllm_config, "AscendMLABackend")
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        threshold = int(self.reorder_batch_threshold or 1)
        if threshold > MAX_DECODE_THRESHOLD:
            raise ConfigError(
                f"speculative decoding with {threshold - 1} speculative tokens gives AscendMLABackend a decode "
                f"threshold of {threshold}, above the NPU kernel's {MAX_DECODE_THRESHOLD} query tokens per request; "
                f"use num_speculative_tokens <= {MAX_DECODE_THRESHOLD - 1}"
            )
        self._masks = AttentionMaskBuilder(device) if kernel_backend() == "npu" else None
        #: Builds whose decode part had several query tokens per request (read by ``npu_runtime_info``).
        self.multi_token_decode_builds = 0
        self.block_size = kv_cache_spec.block_size
        self.context_chunk_tokens: int = MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size(vllm_config)

    def _plan_context_chunks(self, context_lens: torch.Tensor) -> list[AscendMLAContextChunk]:
        with_ctx = int((context_lens > 0).sum())
        if with_ctx == 0:
            return []
        # at least one block per request (vLLM sizes the budget for max_num_seqs blocks, so this stays within it)
        per_req = max(self.block_size, (self.context_chunk_tokens // with_ctx) // self.block_size * self.block_size)
        num_chunks = -(-int(context_lens.max()) // per_req)
        chunks = []
        for c in range(num_chunks):
            starts = torch.full_like(context_lens, c * per_req)
            lens = (context_lens - starts).clamp(min=0, max=per_req)
            chunks.append(
                AscendMLAContextChunk(
                    starts=starts.to(torch.int32).to(self.device),
                    lens=lens.to(torch.int32).to(self.device),
                    lens_list=lens.tolist(),
                    total=int(lens.sum()),
                )
            )
        return chunks

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> AscendMLAMetadata:
        m = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            m, decode_threshold=self.reorder_batch_threshold
        )
        qsl_cpu = m.query_start_loc_cpu
        seq_lens_cpu = m.seq_lens_cpu

        decode = None
        if num_decodes > 0:
            decode_query_lens: list[int] = (qsl_cpu[1 : num_decodes + 1] - qsl_cpu[:num_decodes]).tolist()
            max_query_len = max(decode_query_lens)
            self.multi_token_decode_builds += max_query_len > 1
            decode = AscendMLADecodeMetadata(
                block_table=m.block_table_tensor[:num_decodes],
                seq_lens=m.seq_lens[:num_decodes],
                seq_lens_list=seq_lens_cpu[:num_decodes].tolist(),
                query_lens=decode_query_lens,
                max_query_len=max_query_len,
                attn_mask=self._masks.splitfuse_mask() if self._masks is not None and max_query_len > 1 else None,
            )

        prefill = None
        if num_prefills > 0:
            r0 = num_decodes
            qsl = qsl_cpu[r0:] - qsl_cpu[r0]
            query_lens = qsl[1:] - qsl[:-1]
            context_lens = seq_lens_cpu[r0 : m.num_reqs] - query_lens
            prefill = AscendMLAPrefillMetadata(
                block_table=m.block_table_tensor[r0 : m.num_reqs],
                query_start_loc=m.query_start_loc[r0:] - m.query_start_loc[r0],
                max_query_len=int(query_lens.max()),
                query_lens=query_lens.tolist(),
                context_lens=context_lens.tolist(),
                context_chunks=self._plan_context_chunks(context_lens),
            )

        return AscendMLAMetadata(
            num_reqs=m.num_reqs,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc,
            slot_mapping=m.slot_mapping,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            decode=decode,
            prefill=prefill,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> AscendMLAMetadata:
        """Metadata of the dummy decode batch a full graph is captured with: all decodes, one token per request or,
        with speculative decoding (the torchair mode), up to ``reorder_batch_threshold`` tokens per request."""
        q = common_attn_metadata.max_query_len
        if q > self.reorder_batch_threshold:
            raise ValueError(
                "AscendMLABackend captures full graphs only for decode batches of at most "
                f"{self.reorder_batch_threshold} tokens per request (max_query_len={q})"
            )
        md = self.build(0, common_attn_metadata)
        assert md.prefill is None and md.decode is not None  # every request of the batch is a decode
        md.capture = True
        return md


def decode_seq_lens_refresh(layer_name: str, batch: int) -> Refresh:
    """The refresh of a captured MLA decode kernel: this step's sequence lengths of ``layer_name``'s decode requests,
    padded to the graph's ``batch`` with 1 (a padding request attends to one cached slot; its row is discarded)."""

    def refresh() -> dict[str, list[int]]:
        from vllm.forward_context import get_forward_context

        # vLLM types attn_metadata as every runner's shape; the V1 runner with this backend sets one per layer name.
        metadata = cast("dict[str, AscendMLAMetadata]", get_forward_context().attn_metadata)
        decode = metadata[layer_name].decode
        lens = list(decode.seq_lens_list) if decode is not None else []
        return {"seq_lens": lens + [1] * (batch - len(lens))}

    return refresh


# --- impl -------------------------------------------------------------------------------------------------------


class AscendMLAImpl(MLACommonBaseImpl[AscendMLAMetadata]):
    """MLA attention over the latent cache. Inputs per step (vLLM's ``MultiHeadLatentAttention``):
    ``q [T, N, P + R]`` (rope applied), ``k_c_normed [T, L]``, ``k_pe [T, 1, R]`` (rope applied);
    output ``[T, N * V]``.

    Writes every element of ``output`` on every call (zeros on the profile run and in the padded rows past
    ``num_actual_tokens``), so vLLM's attention layer may hand it an uninitialised buffer (npu-patches'
    ``attention-output-empty`` reads it: the :class:`~vllm_npu.interface.protocols.OutputBufferFiller` contract)."""

    fills_output_buffer: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.kv_cache_dtype not in ("auto", None):
            raise ConfigError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported by AscendMLABackend; use 'auto'"
            )
        self._write = MLA_CACHE_WRITE.select()
        self._load = PAGED_CACHE_LOAD.select()
        self._npu = kernel_backend() == "npu"
        self._decode = MLA_DECODE.select()
        self._spec_decode = MLA_SPEC_DECODE.select()
        self._ring = RING_MLA.select()
        self._graph_write = GRAPH_KV_WRITE.select()
        self._graph_decode = MLA_GRAPH_DECODE.select()
        self._ring_mask: torch.Tensor | None = None
        # True when the MLA layer writes the latent cache itself with the fused k-norm + rope + write kernel
        # (vllm_npu.attention.ops.mla_layer.AscendMultiHeadLatentAttention sets it once, at construction).
        self.layer_writes_cache = False
        # True when the layer would write the cache with that fused kernel but the model is traced (torchair,
        # PIECEWISE): q_pe and k_pe then come GPT-J-rotated from vLLM's forward_native, and the impl puts their rope
        # channels in the fused kernel's NeoX order (deinterleave) so that the cache holds the same layout in every
        # graph mode: a PD pair or a shared KV store whose instances run different modes reads one layout.
        self.rope_deinterleaved = False

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
        attn_metadata: AscendMLAMetadata | None,  # None on vLLM's profile run
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output is None:
            raise KernelContractError("AscendMLAImpl.forward needs the output buffer (accept_output_buffer=True)")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by AscendMLABackend")
        if attn_metadata is None:  # profile run: no cache yet; zeros keep DP/EP ranks consistent
            return output.fill_(0)
        if self.rope_deinterleaved:
            q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
            q, k_pe = torch.cat((q_nope, deinterleave(q_pe)), dim=-1), deinterleave(k_pe)
        graph = compiled_step_inputs(getattr(layer, "layer_name", None))
        if isinstance(graph, GraphDecodeInputs):
            return self._graph_forward(q, k_c_normed, k_pe, kv_cache, graph, output)

        n = attn_metadata.num_actual_tokens
        nd = attn_metadata.num_decode_tokens
        if n < output.shape[0]:  # padded rows (graph-size padding): only the tail; decode/prefill write [:n]
            output[n:].zero_()
        q = q[:n]
        kv_c = k_c_normed[:n]
        k_pe = k_pe[:n].reshape(n, self.qk_rope_head_dim)
        nope, rope = latent_cache_planes(kv_cache, self.kv_lora_rank, self.qk_rope_head_dim)
        if not self.layer_writes_cache:
            self._write(kv_c, k_pe, nope, rope, attn_metadata.slot_mapping[:n])

        if attn_metadata.prefill is not None:
            out = self._forward_prefill(q[nd:], kv_c[nd:], k_pe[nd:], nope, rope, attn_metadata.prefill)
            output[nd:n] = out.reshape(n - nd, -1).to(output.dtype)
        if attn_metadata.decode is not None:
            out = self._forward_decode(q[:nd], nope, rope, attn_metadata.decode, getattr(layer, "layer_name", ""))
            output[:nd] = out.reshape(nd, -1).to(output.dtype)
        return output

    def _up_project(self, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents ``[S, L]`` -> ``k_nope [S, N, P]``, ``v [S, N, V]`` through ``kv_b_proj``."""
        kv = self.kv_b_proj(kv_c)[0].view(-1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return k_nope, v

    def _mask(self, q: torch.Tensor) -> torch.Tensor:
        if self._ring_mask is None or self._ring_mask.device != q.device or self._ring_mask.dtype != q.dtype:
            self._ring_mask = ring_mla_mask(q.dtype, q.device)
        return self._ring_mask

    def _forward_prefill(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        nope: torch.Tensor,
        rope: torch.Tensor,
        meta: AscendMLAPrefillMetadata,
    ) -> torch.Tensor:
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        k_nope, v = self._up_project(kv_c)
        out, lse = self._ring(
            q_nope, q_pe, k_nope, k_pe.unsqueeze(1), v, meta.query_lens, meta.query_lens, self.scale, True,
            mask=self._mask(q),
        )  # fmt: skip
        for chunk in meta.context_chunks:
            ctx_c, ctx_pe = self._load(nope, rope, meta.block_table, chunk.lens, chunk.starts, chunk.total)
            ctx_nope, ctx_v = self._up_project(ctx_c)
            out, lse = self._ring(
                q_nope, q_pe, ctx_nope, ctx_pe.unsqueeze(1), ctx_v, meta.query_lens, chunk.lens_list, self.scale,
                False, prev_out=out, prev_lse=lse, mask=self._mask(q),
            )  # fmt: skip
        return out

    def _forward_decode(
        self, q: torch.Tensor, nope: torch.Tensor, rope: torch.Tensor, meta: AscendMLADecodeMetadata, layer_name: str
    ) -> torch.Tensor:
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        ql_nope = torch.bmm(q_nope.transpose(0, 1), self.W_UK_T).transpose(0, 1)  # [T, N, L]
        if meta.max_query_len > 1:  # verification step: several tokens per request, causal in the draft window
            # (eager: vLLM captures full decode graphs only for one query token per request, the backend's support)
            latent = self._spec_decode(
                ql_nope, q_pe, nope, rope, meta.block_table, meta.query_lens, meta.seq_lens_list, self.scale,
                attn_mask=meta.attn_mask,
            )  # fmt: skip
            return torch.bmm(latent.transpose(0, 1), self.W_UV).transpose(0, 1)  # [T, N, V]
        b = ql_nope.shape[0]
        latent = ql_nope.new_empty(ql_nope.shape)
        scratch: dict[str, Any] = {}  # tensors; typed Any to pass through launch's keywords
        if self._npu:
            # The kernel's BNSD query views need contiguous rows: copied here, before the task, so that the task
            # group holds the .out kernel alone (vllm-ascend v0.11.0 mla_v1.py:1006-1012 makes them before
            # graph_task_group_begin too); inside the kernel the reshapes are then views.
            ql_nope, q_pe = ql_nope.contiguous(), q_pe.contiguous()
        args = (ql_nope, q_pe, nope, rope, meta.block_table)
        if self._npu and active_recorder() is not None:
            # A captured task is re-issued on the addresses it was captured with: its workspace and softmax_lse must
            # be allocated here, before it (vllm-ascend queries the maximum workspace the same way).
            scratch = {
                "workspace": mla_decode_workspace_npu(*args, meta.seq_lens_list, self.scale),
                "lse": ql_nope.new_empty(b),
            }
        # Inside a full decode graph the sequence lengths (a host list) are refreshed before every replay.
        launch(
            self._decode, *args, refresh=decode_seq_lens_refresh(layer_name, b), seq_lens=meta.seq_lens_list,
            scale=self.scale, out=latent, **scratch,
        )  # fmt: skip
        return torch.bmm(latent.transpose(0, 1), self.W_UV).transpose(0, 1)  # [B, N, V]

    def _graph_forward(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        graph: GraphDecodeInputs,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """A decode step inside a compiled graph (the torchair mode): every row of the padded batch written to the
        latent cache and attended, from the graph inputs and shapes only (no host-side slicing by the step's request
        count, which would be baked into the graph); padding rows write to and read vLLM's null block."""
        batch = graph.seq_lens.shape[0]
        if q.shape[0] != batch:
            raise ValueError(
                f"a compiled MLA decode graph of {batch} rows got {q.shape[0]} query tokens; it takes one token per row"
            )
        nope, rope = latent_cache_planes(kv_cache, self.kv_lora_rank, self.qk_rope_head_dim)
        # Always written here: the MLA layer's fused norm + rope + write is off when the model is traced
        # (ops/mla_layer.py). The decode reads the lengths the write returns, which orders it after the write.
        latent, rotated = kv_c.reshape(batch, 1, -1), k_pe.reshape(batch, 1, self.qk_rope_head_dim)
        seq_lens = self._graph_write(latent, rotated, nope, rope, graph.slots, graph.seq_lens)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        ql_nope = torch.bmm(q_nope.transpose(0, 1), self.W_UK_T).transpose(0, 1)  # [B, N, L]
        latent_out = self._graph_decode(
            ql_nope, q_pe, nope, rope, graph.block_table, seq_lens, graph.seq_lens_list, self.scale
        )
        out = torch.bmm(latent_out.transpose(0, 1), self.W_UV).transpose(0, 1)  # [B, N, V]
        return output.copy_(out.reshape(batch, -1))
