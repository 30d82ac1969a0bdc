# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Per-step attention metadata of the GQA backend and the builder that makes it from vLLM's common metadata.

The builder reads only vLLM's ``CommonAttentionMetadata``, the layer group's ``AttentionSpec`` and the
``VllmConfig`` (never the model). It classifies the batch into an :class:`AscendAttentionState` (the kernel choice
of the impl) and keeps both the device tensors and the host lists the NPU kernels take as ``SymInt[]``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.attention.backends.utils import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    split_decodes_and_prefills,
)
from vllm_npu.interface import ConfigError, is_310p, kernel_backend

from .masks import AttentionMaskBuilder
from .ops.paged_attention import DecodePlan, PageScratch

# TND layout of npu_fused_infer_attention_score: a "decode" request may carry at most 16 query tokens.
MAX_DECODE_THRESHOLD = 16
# Sequence length of a padding request in a compiled decode graph (and the floor of every row's length there): it
# attends to slots 0..1 of vLLM's null block 0, which no request reads. Not 1: torch's Dynamo specializes an int
# that is 0 or 1 even under dynamic shapes, so on the NPU (whose kernel takes the lengths as SymInt[]) a padding
# row that later holds a real request would recompile the graph. Real decode rows always have >= 2 tokens (a
# prompt token and the new one).
GRAPH_PAD_SEQ_LEN = 2
# Block sizes the NPU paged kernels accept for every state (FIA paged prefill: multiple of 128, <= 512;
# paged attention v2: <= 128).
NPU_BLOCK_SIZE = 128


def reject_decode_context_parallel(vllm_config: Any, backend: str) -> None:
    """Raise :class:`ConfigError` when ``vllm_config`` asks for decode context parallelism (a KV cache sharded over
    ranks, with ``-1`` slots interleaved among real tokens), which no Ascend metadata builder plans for."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if (getattr(parallel, "decode_context_parallel_size", 1) or 1) > 1:
        raise ConfigError(
            f"decode context parallelism (decode_context_parallel_size > 1) is not supported by {backend}; "
            "run with decode_context_parallel_size=1"
        )


class AscendAttentionState(enum.IntEnum):
    """What kind of batch a step is; decides the kernel (see :mod:`.backends.gqa`)."""

    PrefillNoCache = 0  # every request is a first prefill: no cached context
    PrefillCacheHit = 1  # only prefills (no decodes), some with cached context (prefix hit or later chunk)
    DecodeOnly = 2  # one new token per request
    ChunkedPrefill = 3  # decodes mixed with prefills, with or without cached context
    SpecDecoding = 4  # every request has 1..decode_threshold new tokens, some more than one


def classify_batch(query_lens: torch.Tensor, seq_lens: torch.Tensor, decode_threshold: int) -> AscendAttentionState:
    """The state of a batch from host tensors ``query_lens`` and ``seq_lens`` (``[num_reqs]``, integer)."""
    if query_lens.numel() == 0:
        return AscendAttentionState.DecodeOnly
    if bool(torch.equal(query_lens, seq_lens)):
        return AscendAttentionState.PrefillNoCache
    if bool((query_lens == 1).all()):
        return AscendAttentionState.DecodeOnly
    is_decode = query_lens <= decode_threshold
    if decode_threshold > 1 and bool(is_decode.all()):
        return AscendAttentionState.SpecDecoding
    if not bool(is_decode.any()):
        return AscendAttentionState.PrefillCacheHit
    return AscendAttentionState.ChunkedPrefill


@dataclass(frozen=True)
class GraphDecodeInputs:
    """One decode step laid out for a compiled decode graph of ``B`` rows (``B`` the padded batch, the graph's).

    A row is one query token: in a single-token decode step row ``i`` is request ``i``; in a speculative
    verification step (request ``r`` with ``q_r`` tokens, :meth:`per_token`) each token is a row of its own, with
    its request's block table and the causal length up to and including itself. Rows past the step's tokens are
    padding (block table row of zeros, length
    :data:`GRAPH_PAD_SEQ_LEN`, slot 0: vLLM's null block, which no request reads). Fresh tensors every step: a
    compiled graph takes them as inputs (Dynamo guards only their shapes, dtypes and strides, all fixed by ``B``), and
    ``seq_lens_list``'s ints are symbolic inputs where the graph is compiled with dynamic ints (the NPU).
    """

    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32 (device): cached tokens including the new one
    slots: torch.Tensor  # [B] int64: KV write slots, all in [0, num_blocks * block_size)
    seq_lens_list: list[int]  # the same lengths as a host list: the NPU kernel's SymInt[] (the reference ignores it)

    @classmethod
    def padded(
        cls,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_list: list[int],
        slot_mapping: torch.Tensor,
        num_reqs: int,
        batch_size: int,
    ) -> GraphDecodeInputs:
        """A decode step's first ``num_reqs`` rows (one new token each: ``slot_mapping[i]`` is request ``i``'s)
        padded to ``batch_size`` rows as the class docstring says; lengths raised to at least
        :data:`GRAPH_PAD_SEQ_LEN`, negative (padding) slots to 0."""
        n = num_reqs
        table = block_table.new_zeros(batch_size, block_table.shape[1])
        table[:n] = block_table[:n]
        lens = torch.full((batch_size,), GRAPH_PAD_SEQ_LEN, dtype=torch.int32, device=block_table.device)
        lens[:n] = seq_lens[:n].clamp(min=GRAPH_PAD_SEQ_LEN)
        slots = torch.zeros(batch_size, dtype=torch.long, device=slot_mapping.device)
        slots[:n] = slot_mapping[:n].clamp(min=0)
        host = [max(s, GRAPH_PAD_SEQ_LEN) for s in seq_lens_list[:n]] + [GRAPH_PAD_SEQ_LEN] * (batch_size - n)
        return cls(table, lens, slots, host)

    @classmethod
    def per_token(
        cls,
        block_table: torch.Tensor,
        seq_lens_list: list[int],
        query_lens: list[int],
        slot_mapping: torch.Tensor,
        batch_size: int,
        capture: bool = False,
    ) -> GraphDecodeInputs | None:
        """A decode step whose request ``r`` carries ``query_lens[r] >= 1`` new tokens (speculative verification:
        the last accepted token plus the drafts), laid out one row per token: token ``i`` of request ``r`` gets
        ``r``'s block-table row, the length ``seq_lens_list[r] - query_lens[r] + 1 + i`` (the cached tokens plus the
        request's new tokens up to itself: causal attention within the request, as the multi-token decode kernel's
        mask gives) and slot ``slot_mapping[t]`` (``t`` the token's index in the step). The graph writes every row's
        key before any row attends, so each token sees the ones before it. Padded to ``batch_size`` rows as
        :meth:`padded` pads; with every ``query_lens[r] == 1`` the result equals :meth:`padded`'s.

        None when a real row's causal length is below :data:`GRAPH_PAD_SEQ_LEN`, i.e. 1: a request with nothing
        cached, a prompt of exactly ``1 + k`` tokens prefilled in a step vLLM counts as uniform decode. Its first
        token must see itself only; the floor would let it see the next one, and on the NPU an exact 1 would be
        specialized by Dynamo (a recompile). The wrapper runs such a step eagerly. ``capture``: vLLM's dummy
        capture batch (sequence lengths = query lengths), whose lengths are raised to the floor instead."""
        rows: list[int] = []
        host: list[int] = []
        for r, (seq_len, q) in enumerate(zip(seq_lens_list, query_lens, strict=True)):
            rows += [r] * q
            host += [seq_len - q + 1 + i for i in range(q)]
        if not capture and any(length < GRAPH_PAD_SEQ_LEN for length in host):
            return None
        host = [max(length, GRAPH_PAD_SEQ_LEN) for length in host]
        t = len(rows)
        if t > batch_size:
            raise ValueError(f"a compiled decode graph of {batch_size} rows got a step of {t} query tokens")
        device = block_table.device
        table = block_table.new_zeros(batch_size, block_table.shape[1])
        table[:t] = block_table[torch.tensor(rows, dtype=torch.long, device=device)]
        host += [GRAPH_PAD_SEQ_LEN] * (batch_size - t)
        lens = torch.tensor(host, dtype=torch.int32, device=device)
        slots = torch.zeros(batch_size, dtype=torch.long, device=slot_mapping.device)
        slots[:t] = slot_mapping[:t].clamp(min=0)
        return cls(table, lens, slots, host)


@dataclass
class AscendMetadata:
    """Attention metadata of one step for the GQA backend (shared by the layers of one KV-cache group).

    Tokens are packed request by request; requests with at most ``decode_threshold`` new tokens come first (vLLM
    reorders the batch by ``reorder_batch_threshold``).
    """

    attn_state: AscendAttentionState
    causal: bool
    num_actual_tokens: int
    num_reqs: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    max_query_len: int
    max_seq_len: int
    # device tensors
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative
    seq_lens: torch.Tensor  # [num_reqs] int32, cached + new tokens per request
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    # [>= num_actual_tokens] int64, never negative: vLLM's -1 padding redirected to slot 0 of vLLM's null block (see
    # the builder), on both backends.
    slot_mapping: torch.Tensor
    # host copies, the SymInt[] arguments of the NPU kernels
    query_start_loc_list: list[int]  # num_reqs + 1 entries
    seq_lens_list: list[int]
    # NPU kernel masks (None on the reference backend, whose kernels derive masks from positions):
    # attn_mask is the state's own (float causal for PrefillNoCache, bool pooling mask for encoder-only, the int8
    # splitfuse mask for cache-reading prefill states, None for DecodeOnly); splitfuse_mask is the 2048 int8 mask
    # of the fused-infer-attention paths (also used by sliding-window layers in every state but DecodeOnly, whose
    # window kernel builds a per-request mask).
    attn_mask: torch.Tensor | None = None
    splitfuse_mask: torch.Tensor | None = None
    # Reference backend, DecodeOnly steps: the decode twins' per-step lengths/mask/pages, built once for all layers.
    decode_plan: DecodePlan | None = None
    # Ascend 310P, every causal state but DecodeOnly, both backends: the state's mask in NZ tiles (masks.py), which
    # the 310P NPU kernels take and their twins read back through the layout.
    nz_mask: torch.Tensor | None = None
    # vLLM's dummy batch of a graph capture (build_for_cudagraph_capture): its lengths are not a real step's
    capture: bool = False

    def graph_inputs(self, batch_size: int) -> GraphDecodeInputs | None:
        """This decode step laid out as the inputs of a compiled decode graph of ``batch_size`` rows
        (:class:`~vllm_npu.interface.protocols.GraphInputsProvider`; the torchair wrapper calls it): a DecodeOnly
        step one row per request, a SpecDecoding step (every request a decode of up to ``decode_threshold``
        tokens: speculative verification) one row per token (:meth:`GraphDecodeInputs.per_token`; None: run the
        step eagerly)."""
        n = self.num_reqs
        state = self.attn_state
        spec = state is AscendAttentionState.SpecDecoding and self.num_prefills == 0
        single = state is AscendAttentionState.DecodeOnly and self.num_actual_tokens == n
        if not (spec or single) or self.num_actual_tokens > batch_size:
            raise ValueError(
                f"a compiled decode graph of {batch_size} rows takes a DecodeOnly or SpecDecoding step of at most "
                f"{batch_size} tokens, got {state.name} with {n} requests ({self.num_prefills} prefills) and "
                f"{self.num_actual_tokens} tokens"
            )
        if single:
            return GraphDecodeInputs.padded(
                self.block_table, self.seq_lens, self.seq_lens_list, self.slot_mapping, n, batch_size
            )
        qsl = self.query_start_loc_list
        query_lens = [qsl[i + 1] - qsl[i] for i in range(n)]
        return GraphDecodeInputs.per_token(
            self.block_table, self.seq_lens_list[:n], query_lens, self.slot_mapping, batch_size, self.capture
        )

    @property
    def actual_seq_lengths_q(self) -> list[int]:
        """Cumulative query ends (TND ``actual_seq_lengths``)."""
        return self.query_start_loc_list[1:]


class AscendAttentionMetadataBuilder(AttentionMetadataBuilder[AscendMetadata]):
    """Builds :class:`AscendMetadata` from vLLM's ``CommonAttentionMetadata``.

    ``reorder_batch_threshold`` (= decode threshold) is ``1 + num_speculative_tokens`` so speculative-decoding
    verification steps count as decodes; it must stay <= 16 (the TND layout limit of the NPU kernel).
    """

    # Full graphs for pure-decode batches (FULL_DECODE_ONLY): the decode kernel's sequence lengths are refreshed
    # before every replay (vllm_npu.interface.graphs); prefill kernels take per-request host lists that cannot be.
    cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    _cudagraph_support = cudagraph_support  # the name vLLM reads from 0.11.1 on (get_cudagraph_support)

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self.decode_threshold: int = int(self.reorder_batch_threshold or 1)
        if self.decode_threshold > MAX_DECODE_THRESHOLD:
            raise ConfigError(
                f"speculative decoding with {self.decode_threshold - 1} speculative tokens gives a decode threshold "
                f"of {self.decode_threshold}, above the Ascend attention limit of {MAX_DECODE_THRESHOLD}; "
                f"use num_speculative_tokens <= {MAX_DECODE_THRESHOLD - 1}"
            )
        reject_decode_context_parallel(vllm_config, "the Ascend GQA attention backend")
        self.block_size: int = int(kv_cache_spec.block_size)
        self.dtype: torch.dtype = kv_cache_spec.dtype
        # Decided once, like the impl's kernels: only the NPU kernels take masks (the references derive theirs).
        self.npu_masks: bool = kernel_backend() == "npu"
        if self.npu_masks and self.block_size % NPU_BLOCK_SIZE:
            raise ConfigError(
                f"block_size={self.block_size} is not supported by the Ascend paged attention kernels; "
                f"use --block-size {NPU_BLOCK_SIZE}"
            )
        self.masks = AttentionMaskBuilder(device)
        self.nz_masks: bool = is_310p()  # the 310P kernels (both backends) take NZ masks (backends/gqa_310p.py)
        # Reference backend only: a persistent int64 buffer for the padding-free slot mapping (persistent, so a
        # captured graph that read it at capture sees every later step's slots).
        self._slots: torch.Tensor | None = None
        self._slots_written = 0  # the buffer's prefix the last step wrote (zero past it)
        # Reference backend only: where the decode twin gathers pages, kept across steps (see DecodePlan)
        self._page_scratch = PageScratch()

    def reorder_batch(self, input_batch: Any, scheduler_output: Any) -> bool:
        # vLLM's model runner already reorders by reorder_batch_threshold (decodes first); nothing else to do.
        return False

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AscendMetadata:
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        qsl_cpu = cm.query_start_loc_cpu[: num_reqs + 1]
        seq_lens_cpu = cm.seq_lens_cpu[:num_reqs]
        seq_lens_list = seq_lens_cpu.tolist()  # one list object: the decode plan is matched to it by identity
        if cm.max_query_len == 1 and num_reqs:
            # One new token per request (every decode step): classify_batch's answer from the host list, without
            # its tensor comparisons (cm.max_seq_len is no help: dummy runs set it to max_model_len). Query lengths
            # equal the sequence lengths only if every sequence is 1 long.
            first = max(seq_lens_list) == 1
            state = AscendAttentionState.PrefillNoCache if first else AscendAttentionState.DecodeOnly
        else:
            state = classify_batch(qsl_cpu[1:] - qsl_cpu[:-1], seq_lens_cpu, self.decode_threshold)
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=self.decode_threshold
        )
        return AscendMetadata(
            attn_state=state,
            causal=cm.causal,
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=num_reqs,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc[: num_reqs + 1],
            seq_lens=cm.seq_lens[:num_reqs],
            block_table=cm.block_table_tensor[:num_reqs],
            slot_mapping=self._null_padded_slots(cm.slot_mapping),
            query_start_loc_list=qsl_cpu.tolist(),
            seq_lens_list=seq_lens_list,
            attn_mask=self._mask_for(state, cm),
            splitfuse_mask=self.masks.splitfuse_mask() if self.npu_masks else None,
            decode_plan=(
                DecodePlan.build(seq_lens_list, self.block_size, self.device, self._page_scratch)
                if not self.npu_masks and not self.nz_masks and state is AscendAttentionState.DecodeOnly and num_reqs
                else None
            ),
            nz_mask=self._nz_mask_for(state, cm.causal, qsl_cpu, seq_lens_list) if self.nz_masks else None,
        )

    def _nz_mask_for(
        self, state: AscendAttentionState, causal: bool, qsl_cpu: torch.Tensor, seq_lens: list[int]
    ) -> torch.Tensor | None:
        """The 310P mask of a step (None for decode-only steps, non-causal layers and empty batches)."""
        if not causal or not seq_lens or state is AscendAttentionState.DecodeOnly:
            return None
        if state is AscendAttentionState.PrefillNoCache:
            return self.masks.prefill_mask_nz(seq_lens, self.dtype)
        return self.masks.splitfuse_mask_nz((qsl_cpu[1:] - qsl_cpu[:-1]).tolist(), seq_lens, self.dtype)

    def _null_padded_slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """``slot_mapping`` with every negative (padding) slot replaced by 0, in the builder's persistent buffer.

        Both KV writes rely on it (:mod:`.ops.kv_cache`). The reference writes every row with one ``index_copy_``.
        The NPU's ``_npu_reshape_and_cache`` is captured in full decode graphs, where vLLM 0.11 fills the slots past
        the real tokens with -1 (``gpu_model_runner.py:1181``); no torch_npu 2.8.0 document says the kernel skips a
        negative slot, and vllm-ascend v0.11.0 pads with 0 instead (``worker/model_runner_v1.py:1502-1506``), so
        ours does the same. Slot 0 lies in block 0, which vLLM's block pool reserves as its null block
        (``BlockPool.null_block``, never handed to a request), so a padding row's K/V lands where no request's
        attention reads. Every slot a real token writes is unchanged. Past ``slot_mapping``'s length the buffer
        holds 0 as well."""
        m = slot_mapping.shape[0]
        if self._slots is None or self._slots.shape[0] < m:
            scheduler = getattr(self.vllm_config, "scheduler_config", None)
            size = max(m, int(getattr(scheduler, "max_num_batched_tokens", 0) or 0))
            self._slots = torch.zeros(size, dtype=torch.long, device=slot_mapping.device)
            self._slots_written = 0
        out = self._slots[:m]
        torch.clamp(slot_mapping, min=0, out=out)
        # The tail too: a graph captured at a larger padded batch reads past this step's m, where vLLM's own buffer
        # holds -1 (padding); here it must hold the null slot, not an earlier step's real slot. Only what an earlier,
        # longer step wrote needs zeroing (the rest is still 0).
        if self._slots_written > m:
            self._slots[m : self._slots_written].zero_()
        self._slots_written = m
        return out

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> AscendMetadata:
        """Metadata of the dummy decode batch a full graph is captured with: one token per request (DecodeOnly), or
        with speculative decoding (the torchair mode) up to ``decode_threshold`` tokens per request (SpecDecoding);
        vLLM's dummy sequence lengths equal the query lengths, which would otherwise classify it as a first
        prefill."""
        q = common_attn_metadata.max_query_len
        if q > self.decode_threshold:
            raise ValueError(
                "the Ascend GQA backend captures full graphs only for decode batches of at most "
                f"{self.decode_threshold} tokens per request (max_query_len={q})"
            )
        md = self.build(0, common_attn_metadata)
        md.attn_state = AscendAttentionState.DecodeOnly if q == 1 else AscendAttentionState.SpecDecoding
        md.num_decodes, md.num_decode_tokens, md.num_prefills = md.num_reqs, md.num_actual_tokens, 0
        md.capture = True
        md.attn_mask = None
        return md

    def _mask_for(self, state: AscendAttentionState, cm: CommonAttentionMetadata) -> torch.Tensor | None:
        """The mask the state's NPU kernel takes; the reference kernels derive theirs from positions."""
        if not self.npu_masks:
            return None
        if not cm.causal:
            return self.masks.pooling_mask()
        if state is AscendAttentionState.DecodeOnly:
            return None
        if state is AscendAttentionState.PrefillNoCache and self.dtype.is_floating_point:
            return self.masks.causal_mask(cm.max_seq_len, self.dtype)
        # cache-reading states, and every prefill over an int8 (C8) cache: the C8 impl attends over the cache there
        return self.masks.splitfuse_mask()
