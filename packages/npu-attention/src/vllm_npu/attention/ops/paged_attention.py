# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Attention of new query tokens over the paged KV cache (decode, chunked prefill, prefix hits, spec decode).

Two kernels, each an NPU call beside its reference twin:

``paged_decode`` — one query token per request (DecodeOnly without a sliding window):
    query ``[B, N, D]``; key_cache/value_cache ``[num_blocks, block_size, Nkv, D]``; block_table ``[B, max_blocks]``
    int32; context_lens ``list[int]`` (B entries, tokens in the cache including the new one); out ``[B, N, D]``
    written in place. ``out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b`` over the request's ``context_lens[b]``
    cached tokens, KV head ``h // (N // Nkv)``, no mask.
    NPU: ``torch_npu.atb._npu_paged_attention_v2`` (documented ATB op; block_size % 16 == 0 and <= 128,
    head_size <= 256). Inside a captured graph it takes ``workspace``, sized for the step's ``context_lens`` by
    ``_npu_paged_attention_v2_get_workspace`` (:func:`paged_decode_workspace_npu`, the task's ``prepare``: at
    capture and before every task update, as vllm-ascend v0.11.0 re-queries ``_npu_paged_attention_get_workspace``,
    ``compilation/acl_graph.py:279-299``: the kernel "requires different workspace among various seq_lens").

``paged_decode_window`` — the same with a sliding window ``W`` (DecodeOnly): token ``b`` sees cache positions
    ``j > context_lens[b] - 1 - W``; ``seq_lens`` is ``context_lens`` as a device tensor ``[B]``.
    NPU: ``torch_npu.npu_fused_infer_attention_score.out`` in BSH with Q_S = 1 and an explicit window mask
    ``[B, 1, max_blocks * block_size]`` (``sparse_mode=0``): with one query token the kernel ignores ``pre_tokens``
    and ``sparse_mode``, so a band would silently attend to the whole context. Inside a captured graph the mask,
    the softmax LSE buffer and the kernel's maximum workspace are made before the task
    (:mod:`.window_decode_npu`), so the task group holds the ``.out`` kernel alone, as torch_npu's own graph
    dispatch does (``npu/graphs.py:137-160``).

``paged_prefill`` — any number of query tokens per request, packed (TND):
    query ``[T, N, D]``; caches as above (the new tokens are already written); block_table ``[B, max_blocks]``;
    query_start_loc ``list[int]`` (B + 1 cumulative offsets, ``query_start_loc[-1] == T``); seq_lens ``list[int]``
    (B, cached tokens per request including the new ones); out ``[T, N, D]`` in place.
    Causal, bottom-right aligned: new token ``i`` (0-based) of request ``b`` with ``q_b`` new and ``L_b`` total
    tokens sees cache positions ``j <= L_b - q_b + i``, and with ``sliding_window = W`` also ``j > L_b - q_b + i - W``.
    NPU: ``torch_npu.npu_fused_infer_attention_score`` in TND layout with the paged cache viewed as
    ``[num_blocks, block_size, Nkv * D]``: ``sparse_mode=3`` (right-down causal) with the 2048 int8 splitfuse mask,
    or ``sparse_mode=4`` (band, right-down origin) with ``pre_tokens = W - 1, next_tokens = 0`` for a sliding window.
    FIA needs block_size a multiple of 128 (<= 512) for query lengths > 1 and fp16/bf16.

The decode twins take an optional ``plan`` (:class:`DecodePlan`): the reference twin's per-step work (lengths tensor,
padding mask, pages to gather) that the metadata builder makes once per step instead of once per layer. The NPU
twins ignore it (the kernels derive everything from ``context_lens``); the reference twin uses it only when it was
built for this very ``context_lens`` list and otherwise builds its own, so a plan never changes a result.

Logits soft-capping has no torch_npu kernel: the NPU twins reject it (the backend refuses such layers up front on
the NPU); the reference twins apply ``cap * tanh(scores / cap)`` to the scaled scores (vLLM/flash-attn semantics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm_npu.interface import Kernel, KernelContractError

from ._checks import check_heads, need_mask, no_soft_cap
from ._reference import _MASKED, attend, gather_pages, gather_sequence, window_allowed
from .fia import fia, gqa_paged_tnd
from .window_decode_npu import paged_decode_window_npu

# Requests with at most this many new tokens are computed together in one padded batch by the reference (decodes,
# speculative-decoding verification); longer ones one request at a time.
_SHORT_QUERY = 16


# --- paged decode ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodePlan:
    """What the reference decode twins derive from one step's ``context_lens``, shared by every layer of the step.

    ``context_lens`` is the host list it was built for (checked by identity); ``lens [B]`` int64 the same values on
    the device; ``num_blocks`` the pages gathered per request (``ceil(max(context_lens) / block_size)``);
    ``positions [S]`` the gathered token positions ``0..S-1`` (``S = num_blocks * block_size``); ``masked
    [B, 1, 1, 1, S]`` True where a position is past the request's length (the scores' padding mask); ``bias
    [B, 1, 1, S]`` float32, the same mask as an additive term (0 visible, the reference's large finite negative
    hidden), the form the fused attention of :func:`_decode` takes.

    The pages a block table gives for the step (``block_table[:, :num_blocks]``, flattened) are made by the first
    layer that asks (:meth:`pages`) and kept for the others: every layer of a KV-cache group reads the same block
    table in one step, and a plan lives for one step. So is :meth:`run`, whether those pages lie in the cache as one
    strided run (then the twin reads the cache in place, without a gather).

    ``scratch`` (optional, :class:`PageScratch`): where the twin gathers pages, reused by every layer and, when the
    metadata builder owns it, every step; without it each gather allocates (at long contexts a fresh buffer of
    hundreds of MB per layer, whose page faults cost more than the copy).
    """

    context_lens: list[int]
    block_size: int
    num_blocks: int
    lens: torch.Tensor
    positions: torch.Tensor
    masked: torch.Tensor
    bias: torch.Tensor
    scratch: PageScratch | None = field(default=None, compare=False, repr=False)
    # (address, rows, row stride) of a block table -> its flattened pages / its run; see the class docstring
    _pages: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    _runs: dict[tuple[int, int, int], tuple[int, int] | None] = field(default_factory=dict, compare=False, repr=False)

    def pages(self, block_table: torch.Tensor) -> torch.Tensor:
        """``block_table[:, :num_blocks]`` flattened (int, ``[B * num_blocks]``), made once per block table."""
        key = (block_table.data_ptr(), block_table.shape[0], block_table.stride(0))
        pages = self._pages.get(key)
        if pages is None:
            pages = self._pages[key] = block_table[:, : self.num_blocks].reshape(-1)
        return pages

    def run(self, block_table: torch.Tensor) -> tuple[int, int] | None:
        """``(first, spacing)`` when row ``b`` of ``block_table[:, :num_blocks]`` is the consecutive blocks
        ``first + b * spacing + j`` (``spacing >= 0``; one row: always 0), else None; made once per block table.

        Then every request's pages are one strided view of the cache. vLLM's block pool hands a prompt its blocks in
        order, so a lone request (batch 1) that grew without other requests interleaving their blocks qualifies;
        rows of other lengths never do (their table's tail is block 0), nor do interleaved ones. One host read of the
        table's first ``num_blocks`` columns per step."""
        key = (block_table.data_ptr(), block_table.shape[0], block_table.stride(0))
        if key not in self._runs:
            self._runs[key] = self._find_run(block_table)
        return self._runs[key]

    def _find_run(self, block_table: torch.Tensor) -> tuple[int, int] | None:
        n = self.num_blocks
        row = block_table[0, :n].tolist()  # most tables fail here: read the rest only when row 0 is a run
        first = row[0]
        if row != list(range(first, first + n)):
            return None
        if block_table.shape[0] == 1:
            return first, 0
        rows = block_table[:, :n].tolist()
        spacing = rows[1][0] - first
        if spacing < 0 or any(
            r != list(range(first + b * spacing, first + b * spacing + n)) for b, r in enumerate(rows)
        ):
            return None
        return first, spacing

    @staticmethod
    def build(
        context_lens: list[int], block_size: int, device: torch.device, scratch: PageScratch | None = None
    ) -> DecodePlan:
        num_blocks = max(1, -(-max(context_lens, default=1) // block_size))
        lens = torch.tensor(context_lens, dtype=torch.long, device=device)
        positions = torch.arange(num_blocks * block_size, device=device)
        hidden = positions >= lens[:, None]  # [B, S]
        masked = hidden.view(len(context_lens), 1, 1, 1, -1)
        bias = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, _MASKED).view(len(context_lens), 1, 1, -1)
        return DecodePlan(context_lens, block_size, num_blocks, lens, positions, masked, bias, scratch)


class PageScratch:
    """A reusable buffer for the decode twin's page gathers, grown on demand and never shrunk.

    A step's layers run one after another and each consumes its gathered K/V before the next layer gathers, so one
    buffer serves them all; held by the metadata builder (which lives as long as the engine), it serves every step.
    Not for concurrent use from two threads (one engine's forward runs on one thread)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` on ``device`` (contents undefined)."""
        buf = self._buffer
        if buf is None or buf.dtype != dtype or buf.device != device or buf.numel() < numel:
            buf = self._buffer = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


def _plan_for(plan: DecodePlan | None, context_lens: list[int], key_cache: torch.Tensor) -> DecodePlan:
    block_size = key_cache.shape[1]
    if plan is not None and plan.context_lens is context_lens and plan.block_size == block_size:
        return plan
    if len(context_lens) == 0 or min(context_lens) < 1:
        raise KernelContractError(f"paged_decode: context_lens must be >= 1 per request, got {context_lens[:8]}")
    return DecodePlan.build(context_lens, block_size, key_cache.device)


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: DecodePlan,
    masked: torch.Tensor,
    scale: float,
    logits_soft_cap: float | None,
    out: torch.Tensor,
) -> None:
    """One query token per request over its gathered pages: one gather per cache, then one fused fp32 attention.

    ``masked [B, 1, 1, 1, S]`` hides positions (True = hidden); when it is the plan's own padding mask, the plan's
    additive ``bias`` stands for it. Without soft-capping the attention is torch's fused
    ``scaled_dot_product_attention`` (on the CPU, its flash kernel: one pass over the keys with an online softmax),
    with the GQA group folded into the query rows (``[B, Nkv, G, D]``: a group's query heads share their KV head, and
    one decode token has no causal order among them), so neither K nor V is copied per query head. That is the same
    maths as :func:`attend` in another summation order: equal to it within fp32 rounding (test_reference_lean.py
    pins the two), a quarter of the ops. Soft-capping needs the scores themselves: :func:`attend`.
    """
    batch = query.shape[0]
    shape = (batch, plan.num_blocks * plan.block_size, *key_cache.shape[2:])
    if torch.compiler.is_compiling():  # traced (Dynamo): no addresses, no per-step memo
        pages = block_table[:, : plan.num_blocks].reshape(-1)
        k, v = key_cache.index_select(0, pages).view(shape), value_cache.index_select(0, pages).view(shape)
    else:
        run = plan.run(block_table) if _viewable(key_cache) and _viewable(value_cache) else None
        if run is not None:  # the pages lie in the cache as one strided run: read them where they are
            k, v = _run_view(key_cache, run, shape), _run_view(value_cache, run, shape)
        else:
            k, v = _gather_kv(key_cache, value_cache, plan.pages(block_table), shape, plan.scratch)
    if logits_soft_cap:
        o = attend(query[:, None], k, v, None, scale, logits_soft_cap, masked=masked)
        out.copy_(o.view_as(out))
        return
    nkv, d = key_cache.shape[2], key_cache.shape[3]
    if masked is plan.masked:
        bias = plan.bias
    else:  # a layer's own mask (sliding window): SDPA's bool form, True = attend
        bias = ~masked.view(batch, 1, 1, -1)
    if query.dtype != torch.float32:  # fp16/bf16 caches: the attention computes in fp32 (no-op calls cost too)
        query, k, v = query.float(), k.float(), v.float()
    o = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, nkv, -1, d), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale
    )
    out.copy_(o.view_as(out))


def _viewable(cache: torch.Tensor) -> bool:
    """Whether ``cache [num_blocks, block_size, Nkv, D]`` has its blocks packed (each contiguous, one after another),
    so that the tokens of consecutive blocks are equally spaced and a run of blocks is a view."""
    _, bs, nkv, d = cache.shape
    return (
        cache.stride(3) == 1 and cache.stride(2) == d and cache.stride(1) == nkv * d and cache.stride(0) == bs * nkv * d
    )


def _run_view(cache: torch.Tensor, run: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    """Request ``b``'s pages, blocks ``first + b * spacing`` onwards of a packed ``cache`` (:func:`_viewable`), as a
    ``shape`` view: no copy."""
    first, spacing = run
    _, _, nkv, d = shape
    offset = cache.storage_offset() + first * cache.stride(0)
    return cache.as_strided(shape, (spacing * cache.stride(0), nkv * d, d, 1), offset)


def _gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    pages: torch.Tensor,
    shape: tuple[int, ...],
    scratch: PageScratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages ``pages`` of both caches, each viewed as ``shape``. When the two caches are the halves of one
    tensor (vLLM's per-layer ``[2, num_blocks, ...]`` KV cache, unbound), one gather over that tensor serves both:
    half the gather calls in the decode step's hottest loop, the same values. With ``scratch`` the pages land in
    its buffer (valid until the next gather into it) instead of a fresh allocation."""
    step = value_cache.data_ptr() - key_cache.data_ptr()
    size = key_cache.element_size()
    if (
        step > 0
        and step % size == 0
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and value_cache.shape == key_cache.shape
        and value_cache.dtype == key_cache.dtype
        and value_cache.untyped_storage().data_ptr() == key_cache.untyped_storage().data_ptr()
    ):
        both = key_cache.as_strided(
            (2, key_cache.shape[0], key_cache.stride(0)), (step // size, key_cache.stride(0), 1)
        )
        if scratch is None:
            kv = both.index_select(1, pages)
        else:
            kv = scratch.take(both.shape[0] * pages.numel() * both.shape[2], both.dtype, both.device)
            kv = torch.index_select(both, 1, pages, out=kv.view(both.shape[0], pages.numel(), both.shape[2]))
        return kv[0].view(shape), kv[1].view(shape)
    if scratch is None or value_cache.dtype != key_cache.dtype or value_cache.shape != key_cache.shape:
        return key_cache.index_select(0, pages).view(shape), value_cache.index_select(0, pages).view(shape)
    n = pages.numel()
    buf = scratch.take(2 * n * key_cache[0].numel(), key_cache.dtype, key_cache.device)
    buf = buf.view(2, n, *key_cache.shape[1:])
    k = torch.index_select(key_cache, 0, pages, out=buf[0])
    v = torch.index_select(value_cache, 0, pages, out=buf[1])
    return k.view(shape), v.view(shape)


def paged_decode_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
    plan: DecodePlan | None = None,
    workspace: torch.Tensor | None = None,
) -> None:
    no_soft_cap(logits_soft_cap, "paged_decode")
    import torch_npu

    torch_npu.atb._npu_paged_attention_v2(
        query,
        key_cache,
        block_table,
        context_lens,
        value_cache=value_cache,
        num_kv_heads=num_kv_heads,
        num_heads=num_heads,
        scale_value=scale,
        mask_type=0,
        workspace=workspace,
        out=out,
    )


def paged_decode_workspace_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    *,
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
    **_: object,
) -> dict[str, torch.Tensor]:
    """``{"workspace": ...}`` for :func:`paged_decode_npu` at these ``context_lens``: the ``prepare`` of a captured
    decode task (:func:`vllm_npu.interface.graphs.launch`), called outside its task group at capture and before
    every update. ``_npu_paged_attention_v2_get_workspace`` takes the op's arguments (its registered 2.8.0 schema:
    ``(query, key_cache, block_table, SymInt[] context_lens, *, value_cache, mask, num_kv_heads, num_heads,
    scale_value, mask_type, Tensor(a!) out) -> Tensor``)."""
    import torch_npu

    workspace: torch.Tensor = torch_npu.atb._npu_paged_attention_v2_get_workspace(
        query,
        key_cache,
        block_table,
        context_lens,
        value_cache=value_cache,
        num_kv_heads=num_kv_heads,
        num_heads=num_heads,
        scale_value=scale,
        mask_type=0,
        out=out,
    )
    return {"workspace": workspace}


def paged_decode_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
    plan: DecodePlan | None = None,
    workspace: torch.Tensor | None = None,  # the NPU kernel's scratch; unused here
) -> None:
    check_heads(query, key_cache, num_heads, num_kv_heads, "paged_decode")
    plan = _plan_for(plan, context_lens, key_cache)
    _decode(query, key_cache, value_cache, block_table, plan, plan.masked, scale, logits_soft_cap, out)


PAGED_DECODE = Kernel("paged_decode", npu=paged_decode_npu, reference=paged_decode_reference)


# --- paged decode with a sliding window -----------------------------------------------------------------------------


def paged_decode_window_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    sliding_window: int,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
    plan: DecodePlan | None = None,
    mask: torch.Tensor | None = None,  # the NPU kernel's scratch (paged_decode_window_scratch_npu); unused here
    lse: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> None:
    check_heads(query, key_cache, num_heads, num_kv_heads, "paged_decode_window")
    plan = _plan_for(plan, context_lens, key_cache)
    # The window is the layer's own: positions at or before len - 1 - W are hidden too.
    first = (plan.lens - sliding_window).view(-1, 1, 1, 1, 1)
    masked = plan.masked | (plan.positions < first)
    _decode(query, key_cache, value_cache, block_table, plan, masked, scale, logits_soft_cap, out)


PAGED_DECODE_WINDOW = Kernel(
    "paged_decode_window", npu=paged_decode_window_npu, reference=paged_decode_window_reference
)


# --- paged prefill (chunked prefill, prefix hits, mixed batches, spec decode) -------------------------------------


def paged_prefill_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    no_soft_cap(logits_soft_cap, "paged_prefill")
    mask = need_mask(attn_mask, "paged_prefill")
    args = gqa_paged_tnd(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, mask,
        sliding_window=sliding_window, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
    )  # fmt: skip
    out.copy_(fia(args).view_as(out))


def paged_prefill_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    check_heads(query, key_cache, num_heads, num_kv_heads, "paged_prefill")
    num_reqs = len(seq_lens)
    if len(query_start_loc) != num_reqs + 1:
        raise KernelContractError(
            f"paged_prefill: query_start_loc has {len(query_start_loc)} entries, expected {num_reqs + 1}"
        )
    q_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(num_reqs)]
    if any(q > s for q, s in zip(q_lens, seq_lens)):
        raise KernelContractError("paged_prefill: a request has more new tokens than cached tokens (seq_lens)")
    short = [i for i in range(num_reqs) if 0 < q_lens[i] <= _SHORT_QUERY]
    if short:
        _prefill_short(
            query,
            key_cache,
            value_cache,
            block_table,
            query_start_loc,
            q_lens,
            seq_lens,
            short,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            out=out,
        )
    for i in range(num_reqs):
        if q_lens[i] <= _SHORT_QUERY:
            continue
        start, end, seq_len = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
        k = gather_sequence(key_cache, block_table[i], seq_len)
        v = gather_sequence(value_cache, block_table[i], seq_len)
        k_pos = torch.arange(seq_len, device=query.device)
        allowed = window_allowed(k_pos[seq_len - q_lens[i] :], k_pos, causal=True, sliding_window=sliding_window)
        o = attend(query[start:end], k, v, allowed, scale, logits_soft_cap)
        out[start:end] = o.to(out.dtype)


PAGED_PREFILL = Kernel("paged_prefill", npu=paged_prefill_npu, reference=paged_prefill_reference)


# --- reference helpers --------------------------------------------------------------------------------------------


def _attend_short_group(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    *,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> torch.Tensor:
    """Batched causal paged attention for a group of requests with few new tokens each.

    query ``[B, Qmax, N, D]`` (row ``r`` of request ``b`` is its ``r``-th new token; rows past ``query_lens[b]`` are
    padding and come back as garbage); block_table ``[B, max_blocks]``; seq_lens/query_lens ``[B]``.
    Returns fp32 ``[B, Qmax, N, D]``.
    """
    k = gather_pages(key_cache, block_table, max_seq_len)
    v = gather_pages(value_cache, block_table, max_seq_len)
    q_max = query.shape[1]
    k_pos = torch.arange(k.shape[1], device=query.device)
    q_pos = (seq_lens - query_lens)[:, None] + torch.arange(q_max, device=query.device)[None, :]
    # Causality also hides every page slot past the request's own length: for a real row, q_pos < seq_len.
    allowed = window_allowed(
        q_pos, k_pos[None, :].expand(q_pos.shape[0], -1), causal=True, sliding_window=sliding_window
    )
    return attend(query, k, v, allowed, scale, logits_soft_cap)


def _prefill_short(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: list[int],
    q_lens: list[int],
    seq_lens: list[int],
    reqs: list[int],
    *,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    out: torch.Tensor,
) -> None:
    device = query.device
    idx = torch.tensor(reqs, dtype=torch.long, device=device)
    starts = torch.tensor([query_start_loc[i] for i in reqs], dtype=torch.long, device=device)
    qlens = torch.tensor([q_lens[i] for i in reqs], dtype=torch.long, device=device)
    slens = torch.tensor([seq_lens[i] for i in reqs], dtype=torch.long, device=device)
    q_max = max(q_lens[i] for i in reqs)
    rows = torch.arange(q_max, device=device)[None, :]
    valid = rows < qlens[:, None]
    tokens = torch.where(valid, starts[:, None] + rows, starts[:, None])  # padding rows re-read the first token
    o = _attend_short_group(
        query[tokens],
        key_cache,
        value_cache,
        block_table[idx],
        seq_lens=slens,
        query_lens=qlens,
        max_seq_len=max(seq_lens[i] for i in reqs),
        scale=scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    out[tokens[valid]] = o[valid].to(out.dtype)
