# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The Ascend attention backend for standard MHA / GQA / MQA decoder and encoder-only layers.

Kernel per step (the metadata's :class:`~vllm_npu.attention.metadata.AscendAttentionState`):

======================================  ==========================================================================
compiled decode graph (torchair mode)   ``graph_kv_write`` + ``graph_decode`` on the metadata's graph inputs
encoder-only layer (bidirectional)      ``encoder_attention`` over the step's own K/V (no cache)
PrefillNoCache, no sliding window       ``prefill_no_cache`` over the step's own K/V
DecodeOnly, no sliding window           ``paged_decode`` over the paged cache
DecodeOnly, sliding window              ``paged_decode_window`` (one token per request: an explicit window mask)
every other state / any sliding window  ``paged_prefill`` (fused infer attention, TND, right-down causal or band)
int8 KV cache (C8), DecodeOnly          ``c8_kv_write`` + ``c8_paged_decode`` (FIA BSH, antiquant in the kernel)
int8 KV cache (C8), every other state   ``c8_kv_write`` + ``c8_paged_prefill`` (FIA TND over the int8 pages)
======================================  ==========================================================================

A compiled decode graph (``npu.graph_mode='torchair'``: the platform then answers ``opaque_attention_op()`` False for
GQA models, so vLLM's attention layer calls this impl directly and Dynamo traces it into the model's graph) is a step
that hands this layer graph inputs (:meth:`AscendMetadata.graph_inputs`, through
:func:`vllm_npu.interface.graphs.compiled_step_inputs`): the impl then reads only those and the query's shapes,
nothing the host decides per step (:mod:`..ops.graph_decode`).

Decoder layers first write the step's K/V into the cache (``reshape_and_cache``). Each kernel is picked once when
the layer is built (:meth:`vllm_npu.interface.Kernel.select`): the torch_npu call on an NPU, its pure-PyTorch twin
on the emulated device.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypedDict, cast

import torch
from vllm.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionLayer, AttentionType
from vllm_npu.interface import (
    ConfigError,
    Refresh,
    active_recorder,
    compiled_step_inputs,
    is_310p,
    kernel_backend,
    launch,
)

from ..metadata import AscendAttentionMetadataBuilder, AscendAttentionState, AscendMetadata, GraphDecodeInputs
from ..ops.c8_cache import C8_KV_WRITE, C8_PAGED_DECODE, C8_PAGED_PREFILL, c8_paged_decode_scratch_npu
from ..ops.flash_attention import ENCODER_ATTENTION, PREFILL_NO_CACHE
from ..ops.graph_decode import GRAPH_DECODE, GRAPH_KV_WRITE
from ..ops.kv_cache import RESHAPE_AND_CACHE
from ..ops.nz import nz_kv_cache_shape
from ..ops.paged_attention import (
    PAGED_DECODE,
    PAGED_DECODE_WINDOW,
    PAGED_PREFILL,
    DecodePlan,
    paged_decode_workspace_npu,
)
from ..ops.window_decode_npu import paged_decode_window_scratch_npu
from .gqa_310p import Kernels310P, forward_310p

# torch_npu paged attention v2 takes head sizes up to 256, fused infer attention needs multiples of 16.
NPU_MAX_HEAD_SIZE = 256
NPU_HEAD_ALIGN = 16
NPU_DTYPES = (torch.float16, torch.bfloat16)
#: The int8 KV cache of a C8 checkpoint (vLLM's ``cache_dtype`` string, set by the platform for such checkpoints).
C8_CACHE_DTYPE = "int8"
# torch_npu 2.8.0 FIA docs: with int8 K/V the head dim must be 32-aligned and the paged block size too.
NPU_INT8_ALIGN = 32


class _PaddedStep:
    """The last step's lengths padded to a graph's batch, with their decode plan: every layer's refresh of one step
    reads the same metadata list (one metadata per KV-cache group), so the padded list and its plan are made once
    per step, not once per layer. Holding ``source`` keeps its identity meaningful."""

    source: ClassVar[list[int] | None] = None
    batch: ClassVar[int] = 0
    lens: ClassVar[list[int]] = []
    plan: ClassVar[DecodePlan | None] = None


def decode_lens_refresh(layer_name: str, batch: int) -> Refresh:
    """The refresh of a captured decode kernel: this step's sequence lengths of ``layer_name``'s requests, padded to
    the graph's ``batch`` with 1 (padding requests attend to one cached slot; their rows are discarded), and on the
    reference backend the step's :class:`DecodePlan` for exactly that list (the metadata builder's own when no
    padding is needed), so the twin does not rebuild it in every layer. The NPU kernel ignores the plan."""

    def refresh() -> dict[str, Any]:
        from vllm.forward_context import get_forward_context

        # vLLM types attn_metadata as every runner's shape; the V1 runner with this backend sets one per layer name.
        metadata = cast("dict[str, AscendMetadata]", get_forward_context().attn_metadata)
        md = metadata[layer_name]
        lens, plan = md.seq_lens_list, md.decode_plan
        if len(lens) == batch:
            return {"context_lens": lens, "plan": plan}
        step = _PaddedStep
        if step.source is not lens or step.batch != batch:
            step.source, step.batch = lens, batch
            step.lens = lens + [1] * (batch - len(lens))
            step.plan = (
                None if plan is None else DecodePlan.build(step.lens, plan.block_size, plan.lens.device, plan.scratch)
            )
        return {"context_lens": step.lens, "plan": step.plan}

    return refresh


def _backend_name() -> str:
    """The GQA backend's name for vLLM. From 0.11.1 vLLM's ``Attention`` looks the name up in its
    ``AttentionBackendEnum``, whose member for out-of-tree backends is ``CUSTOM`` (what vllm-ascend's GQA backend
    returns on vLLM 0.12: v0.12.0rc1 attention_v1.py); 0.11.0 has no such lookup and the name is our own."""
    try:
        from vllm.attention.backends.registry import AttentionBackendEnum  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return "ASCEND"
    return "CUSTOM" if "CUSTOM" in AttentionBackendEnum.__members__ else "ASCEND"


_BACKEND_NAME = _backend_name()


class AscendAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True

    @staticmethod
    def get_name() -> str:
        return _BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[AscendAttentionImpl]:
        return AscendAttentionImpl

    # get_metadata_cls / AttentionImpl[...]: vLLM types these with v0's AttentionMetadata marker class, which no v1 metadata class subclasses (its own FlashAttentionMetadata and MLACommonMetadata included).
    @staticmethod
    def get_metadata_cls() -> type[AscendMetadata]:  # type: ignore[override]
        return AscendMetadata

    @staticmethod
    def get_builder_cls() -> type[AscendAttentionMetadataBuilder]:
        return AscendAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``: K and V pages, token-major inside a block; on an
        Ascend 310P ``(2, num_blocks, num_kv_heads * head_size / 16, block_size, 16)``, each block's
        ``[block_size, Nkv * D]`` page in NZ tiles of 16 (:mod:`..ops.nz`)."""
        if block_size % 16:
            raise ValueError(f"block_size={block_size} must be a multiple of 16 for the Ascend attention backend")
        if is_310p():
            return nz_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
        if cache_dtype_str == C8_CACHE_DTYPE and kernel_backend() == "npu" and block_size % NPU_INT8_ALIGN:
            raise ConfigError(
                f"block_size={block_size}: an int8 KV cache (C8) needs a multiple of {NPU_INT8_ALIGN} on the NPU "
                "(fused infer attention over int8 pages); use --block-size 128"
            )
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        return (0, 1, 2, 3, 4)

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        if kernel_backend() == "npu":
            return list(NPU_DTYPES)
        return [torch.float16, torch.bfloat16, torch.float32]


class _Heads(TypedDict):
    """The head arguments every GQA kernel twin takes."""

    num_heads: int
    num_kv_heads: int
    scale: float
    logits_soft_cap: float | None


class AscendAttentionImpl(AttentionImpl[AscendMetadata]):  # type: ignore[type-var]  # see get_metadata_cls
    """Forward of one attention layer. Layouts: query ``[T, N, D]``, key/value ``[T, Nkv, D]``, output ``[T, N, D]``,
    kv_cache ``[2, num_blocks, block_size, Nkv, D]``.

    Writes every element of ``output`` on every call (zeros on the profile run and in the padded rows past
    ``num_actual_tokens``), so vLLM's attention layer may hand it an uninitialised buffer (npu-patches'
    ``attention-output-empty`` reads it: the :class:`~vllm_npu.interface.protocols.OutputBufferFiller` contract)."""

    fills_output_buffer: ClassVar[bool] = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unsupported: Any,
    ) -> None:
        if unsupported:
            raise ConfigError(f"the Ascend attention backend does not support the layer options {sorted(unsupported)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        if sinks is not None:
            raise ConfigError("attention sinks are not supported by the Ascend attention backend")
        if alibi_slopes is not None:
            raise ConfigError("ALiBi attention is not supported by the Ascend GQA backend")
        if kv_cache_dtype not in ("auto", C8_CACHE_DTYPE):
            raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the Ascend GQA backend; use auto")
        self.c8 = kv_cache_dtype == C8_CACHE_DTYPE
        if self.c8:
            self._check_c8(attn_type, sliding_window, logits_soft_cap)
        if attn_type not in (AttentionType.DECODER, AttentionType.ENCODER_ONLY):
            raise ConfigError(
                f"attention type {attn_type!r} (encoder / cross attention) is not supported by the Ascend GQA "
                "backend; only decoder and encoder-only models are"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive, got {sliding_window}")
        backend = kernel_backend()
        self._npu = backend == "npu"
        if self._npu:
            self._check_npu_support()
        self.reshape_and_cache = RESHAPE_AND_CACHE.select(backend)
        self.paged_decode = PAGED_DECODE.select(backend)
        self.paged_decode_window = PAGED_DECODE_WINDOW.select(backend)
        self.paged_prefill = PAGED_PREFILL.select(backend)
        self.prefill_no_cache = PREFILL_NO_CACHE.select(backend)
        self.encoder_attention = ENCODER_ATTENTION.select(backend)
        self.graph_kv_write = GRAPH_KV_WRITE.select(backend)
        self.graph_decode = GRAPH_DECODE.select(backend)
        # Ascend 310P decoder layers: the NZ-cache kernels (backends/gqa_310p.py) instead of the A2/A3 ones.
        self.kernels_310p = Kernels310P(sliding_window) if is_310p() and attn_type == AttentionType.DECODER else None
        self.c8_kv_write = C8_KV_WRITE.select(backend)
        self.c8_paged_decode = C8_PAGED_DECODE.select(backend)
        self.c8_paged_prefill = C8_PAGED_PREFILL.select(backend)

    def _check_c8(self, attn_type: str, sliding_window: int | None, logits_soft_cap: float | None) -> None:
        """Refuse, by name, the layers an int8 KV cache (C8) cannot serve (never a silent float cache)."""
        why = None
        if attn_type != AttentionType.DECODER:
            why = f"a {attn_type} layer keeps no KV cache (encoder-only / bidirectional attention)"
        elif sliding_window is not None:
            why = f"sliding-window attention (window {sliding_window}) has no C8 kernel path here"
        elif logits_soft_cap:
            why = "logits soft-capping has no C8 kernel path here"
        elif kernel_backend() == "npu" and self.head_size % NPU_INT8_ALIGN:
            why = f"head_size={self.head_size}: int8 K/V need a multiple of {NPU_INT8_ALIGN} in the NPU kernel"
        if why is not None:
            raise ConfigError(
                f"this checkpoint's int8 KV cache (C8: kv_quant_type / kv_cache_type C8) cannot serve this "
                f"attention layer: {why}. Serve the model from a checkpoint without KV-cache quantization"
            )

    def _check_npu_support(self) -> None:
        if self.logits_soft_cap is not None:
            raise ConfigError(
                "logits soft-capping (e.g. Gemma-2) has no torch_npu attention kernel; serve this model with "
                '--additional-config \'{"npu": {"kernels": "reference"}}\' or without soft-capping'
            )
        if self.head_size % NPU_HEAD_ALIGN or self.head_size > NPU_MAX_HEAD_SIZE:
            raise ConfigError(
                f"head_size={self.head_size} is not supported by the Ascend attention kernels "
                f"(needs a multiple of {NPU_HEAD_ALIGN}, at most {NPU_MAX_HEAD_SIZE})"
            )
        dtype = torch.get_default_dtype()  # vLLM builds layers under the model dtype
        if dtype not in NPU_DTYPES:
            raise ConfigError(f"the Ascend attention kernels compute in float16/bfloat16, not {dtype}; use --dtype")

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AscendMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output is None:
            raise ValueError("AscendAttentionImpl.forward needs the output buffer (accept_output_buffer=True)")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the Ascend GQA backend")
        if attn_metadata is None:  # profile / dummy run: nothing to attend to, but the buffer must be written
            return output.zero_()
        graph = compiled_step_inputs(getattr(layer, "layer_name", None))
        if isinstance(graph, GraphDecodeInputs):
            return self._graph_decode(query, key, value, kv_cache, graph, output)
        md = attn_metadata
        n = md.num_actual_tokens
        if n < output.shape[0]:  # padded rows (graph-size padding): only the tail, the kernels write [:n]
            output[n:].zero_()
        q, out = query[:n], output[:n]
        heads: _Heads = {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "scale": self.scale,
            "logits_soft_cap": self.logits_soft_cap,
        }

        if self.attn_type == AttentionType.ENCODER_ONLY or not md.causal:
            self.encoder_attention(
                q,
                key[:n],
                value[:n],
                md.query_start_loc_list,
                md.max_query_len,
                attn_mask=md.attn_mask,
                out=out,
                sliding_window=self.sliding_window,
                **heads,
            )
            return output

        if self.kernels_310p is not None:
            write_kv = self.kv_sharing_target_layer_name is None
            k, v = (key[:n], value[:n]) if key is not None and value is not None else (None, None)
            forward_310p(self.kernels_310p, md, q, k, v, kv_cache, out, dict(heads), write_kv)
            return output
        if self.c8:
            return self._forward_c8(layer, q, key, value, kv_cache, md, out, output, heads)
        key_cache, value_cache = kv_cache.unbind(0)
        fresh_kv = key is not None and value is not None
        if self.kv_sharing_target_layer_name is None and fresh_kv:
            self.reshape_and_cache(key[:n], value[:n], key_cache, value_cache, md.slot_mapping[:n])

        state = md.attn_state
        if self.sliding_window is None and fresh_kv and state is AscendAttentionState.PrefillNoCache:
            self.prefill_no_cache(q, key[:n], value[:n], md.seq_lens_list, attn_mask=md.attn_mask, out=out, **heads)
        elif state is AscendAttentionState.DecodeOnly:
            # Inside a full decode graph the sequence lengths (host list) are refreshed before every replay.
            refresh = decode_lens_refresh(getattr(layer, "layer_name", ""), len(md.seq_lens_list))
            if self.sliding_window is None:
                launch(
                    self.paged_decode,
                    q,
                    key_cache,
                    value_cache,
                    md.block_table,
                    refresh=refresh,
                    # NPU: the kernel's workspace for this step's lengths, outside the task group
                    prepare=paged_decode_workspace_npu if self._npu else None,
                    context_lens=md.seq_lens_list,
                    out=out,
                    plan=md.decode_plan,
                    **heads,
                )
            else:
                scratch: dict[str, Any] = {}  # tensors; typed Any to pass through launch's keywords
                if self._npu and active_recorder() is not None:
                    # A captured task re-issues only its kernel: mask, LSE and workspace are made here, before it.
                    scratch = paged_decode_window_scratch_npu(
                        q, key_cache, value_cache, md.block_table, md.seq_lens, md.seq_lens_list,
                        sliding_window=self.sliding_window, num_heads=self.num_heads,
                        num_kv_heads=self.num_kv_heads, scale=self.scale,
                    )  # fmt: skip
                launch(
                    self.paged_decode_window,
                    q,
                    key_cache,
                    value_cache,
                    md.block_table,
                    md.seq_lens,
                    refresh=refresh,
                    context_lens=md.seq_lens_list,
                    sliding_window=self.sliding_window,
                    out=out,
                    plan=md.decode_plan,
                    **heads,
                    **scratch,
                )
        else:
            self.paged_prefill(
                q,
                key_cache,
                value_cache,
                md.block_table,
                md.query_start_loc_list,
                md.seq_lens_list,
                attn_mask=md.splitfuse_mask,
                out=out,
                sliding_window=self.sliding_window,
                **heads,
            )
        return output

    def _forward_c8(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        md: AscendMetadata,
        out: torch.Tensor,
        output: torch.Tensor,
        heads: _Heads,
    ) -> torch.Tensor:
        """A decoder step over the int8 KV cache (:mod:`..ops.c8_cache`): the step's K/V quantized into it, then
        every state attends over it (a prefill without cache too), the kernel dequantizing with the layer's scales."""
        n = md.num_actual_tokens
        k_scale, v_scale = c8_scales(layer)
        key_cache, value_cache = kv_cache.unbind(0)
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            self.c8_kv_write(key[:n], value[:n], key_cache, value_cache, md.slot_mapping[:n], k_scale, v_scale)
        if md.attn_state is AscendAttentionState.DecodeOnly:
            refresh = decode_lens_refresh(getattr(layer, "layer_name", ""), len(md.seq_lens_list))
            scratch: dict[str, Any] = {}
            if self._npu and active_recorder() is not None:
                scratch = c8_paged_decode_scratch_npu(
                    q, key_cache, value_cache, md.block_table, k_scale, v_scale, md.seq_lens_list, **_npu_heads(heads)
                )
            launch(
                self.c8_paged_decode,
                q,
                key_cache,
                value_cache,
                md.block_table,
                k_scale,
                v_scale,
                refresh=refresh,
                context_lens=md.seq_lens_list,
                out=out,
                plan=md.decode_plan,
                **heads,
                **scratch,
            )
        else:
            self.c8_paged_prefill(
                q,
                key_cache,
                value_cache,
                md.block_table,
                k_scale,
                v_scale,
                md.query_start_loc_list,
                md.seq_lens_list,
                attn_mask=md.splitfuse_mask,
                out=out,
                **heads,
            )
        return output

    def _graph_decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        graph: GraphDecodeInputs,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """A decode step inside a compiled graph: every row (padding included) written and attended, from the graph
        inputs only (no host-side slicing by the step's request count, which would be baked into the graph)."""
        if self.c8:
            raise ConfigError(
                "npu.graph_mode='torchair' does not run an int8 KV cache (C8): its compiled decode has no C8 path; "
                "use npu.graph_mode='full_decode_only' or 'piecewise'"
            )
        batch = graph.seq_lens.shape[0]
        if query.shape[0] != batch or self.attn_type != AttentionType.DECODER:
            raise ValueError(
                f"a compiled decode graph of {batch} rows got {query.shape[0]} query tokens "
                f"({self.attn_type} layer); it takes one token per row of a decoder layer"
            )
        key_cache, value_cache = kv_cache.unbind(0)
        seq_lens = graph.seq_lens
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            # The decode reads the lengths the write returns: that orders it after the write (ops/graph_decode.py).
            seq_lens = self.graph_kv_write(key, value, key_cache, value_cache, graph.slots, seq_lens)
        self.graph_decode(
            query,
            key_cache,
            value_cache,
            graph.block_table,
            seq_lens,
            graph.seq_lens_list,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            scale=self.scale,
            logits_soft_cap=self.logits_soft_cap,
            sliding_window=self.sliding_window,
            out=output,
        )
        return output


def _npu_heads(heads: _Heads) -> dict[str, Any]:
    return {"num_heads": heads["num_heads"], "num_kv_heads": heads["num_kv_heads"], "scale": heads["scale"]}


def c8_scales(layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's C8 scales (``key_antiquant_scale`` / ``value_antiquant_scale``, ``[Nkv * D]`` float32, set by
    npu-quant's C8 KV-cache method from the checkpoint)."""
    k_scale = getattr(layer, "key_antiquant_scale", None)
    v_scale = getattr(layer, "value_antiquant_scale", None)
    if not isinstance(k_scale, torch.Tensor) or not isinstance(v_scale, torch.Tensor):
        raise ConfigError(
            f"attention layer {getattr(layer, 'layer_name', '?')!r} has an int8 KV cache but no C8 scales: the "
            "int8 cache is only for C8 checkpoints (quant_model_description.json with kv_quant_type / "
            "kv_cache_type C8, served by npu-quant)"
        )
    return k_scale, v_scale
