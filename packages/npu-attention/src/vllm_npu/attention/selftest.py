# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu selftest`` cases for the attention layer's kernel pairs (see :mod:`vllm_npu.interface.selftest`).

Every case builds what the metadata builder would: block tables of distinct, shuffled blocks (block 0 is vLLM's
null block and never handed out), slot mappings inside them, sequence lengths with chunked-prefill, prefix-hit and
decode requests in one batch, and the masks of :mod:`.masks`. The MLA/SFA cases use the sizes the NPU kernels
require (DeepSeek-V2/V3: kv_lora_rank 512, rope 64, qk_nope 128, v_head 128; 32/64/128 local heads; block size 16 or
128); GQA cases use head size 128 and 64 with 8:1 and 4:1 grouping, block size 128 (FIA) and 16/128 (paged decode).
A case's note ``audit #n`` points at the call marked ``#n`` in the status column of ``docs/npu-calls.md``.
"""

from __future__ import annotations

from functools import partial
from itertools import accumulate
from typing import Any

import torch
from vllm_npu.interface import KernelCall, KernelCase, is_310p, randn, randperm

from . import _selftest_kit as kit
from ._selftest_c8 import c8_cases
from ._selftest_kit import HALVES, L, P, R, Spec, grid
from ._selftest_mla import mla_cases
from .masks import AttentionMaskBuilder
from .ops.flash_attention import ENCODER_ATTENTION, PREFILL_NO_CACHE
from .ops.graph_decode import GRAPH_DECODE, GRAPH_KV_WRITE
from .ops.kv_cache import RESHAPE_AND_CACHE
from .ops.paged_attention import PAGED_DECODE, PAGED_DECODE_WINDOW, PAGED_PREFILL
from .ops.sfa_kernels import INDEXER_CACHE_WRITE, LIGHTNING_INDEXER, SPARSE_MLA_ATTENTION
from .ops.vision_attention import VISION_ATTENTION

# --- GQA: one builder per kernel, called through functools.partial with a row of its parameter table --------------


def _cache_write(device: Any, *, nkv: int, d: int, bs: int, dt: str) -> KernelCall:
    seq_lens = [5, 130, 1]
    table, nb = kit.block_table(30, seq_lens, bs, device)
    slots = kit.slots(table, kit.new_token_positions([3, 2, 1], seq_lens), bs).to(torch.int32).to(device)
    t = slots.numel()
    # one (2, nb, bs, Nkv, D) buffer unbound into K and V, as the GQA backend does; untouched slots stay
    k_cache, v_cache = randn(31, 2, nb, bs, nkv, d, dtype=kit.dtype_of(dt), device=device).unbind(0)
    k, v = (
        randn(33, t, nkv, d, dtype=kit.dtype_of(dt), device=device),
        randn(34, t, nkv, d, dtype=kit.dtype_of(dt), device=device),
    )
    return KernelCall((k, v, k_cache, v_cache, slots), {}, _caches_out)


def _caches_out(result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    return {"key_cache": args[2], "value_cache": args[3]}


def _prefill_no_cache(device: Any, *, n: int, nkv: int, d: int, dt: str) -> KernelCall:
    seq_lens = [3, 17, 40]
    t = sum(seq_lens)
    mask = AttentionMaskBuilder(device).causal_mask(max(seq_lens), kit.dtype_of(dt))
    q, k, v = (randn(35 + i, t, h, d, dtype=kit.dtype_of(dt), device=device) for i, h in enumerate((n, nkv, nkv)))
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, attn_mask=mask, out=torch.zeros_like(q))
    return KernelCall((q, k, v, seq_lens), kw, kit.out_kwarg)


def _encoder(device: Any, *, n: int, nkv: int, d: int, dt: str, w: int | None) -> KernelCall:
    seq_lens = [4, 21, 9]
    t = sum(seq_lens)
    q, k, v = (randn(38 + i, t, h, d, dtype=kit.dtype_of(dt), device=device) for i, h in enumerate((n, nkv, nkv)))
    mask = AttentionMaskBuilder(device).pooling_mask()
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, attn_mask=mask, out=torch.zeros_like(q), sliding_window=w)
    return KernelCall((q, k, v, list(accumulate(seq_lens, initial=0)), max(seq_lens)), kw, kit.out_kwarg)


def _vision(device: Any, *, n: int, d: int, dt: str) -> KernelCall:
    seq_lens = [64, 196, 36, 36]
    q, k, v = (randn(60 + i, sum(seq_lens), n, d, dtype=kit.dtype_of(dt), device=device) for i in range(3))
    lens = torch.tensor(seq_lens, dtype=torch.int32)  # on the host, as the kernel reads it
    kw = dict(num_heads=n, num_kv_heads=n, scale=d**-0.5, out=torch.zeros_like(q))
    return KernelCall((q, k, v, lens), kw, kit.out_kwarg)


def _paged_decode(device: Any, *, n: int, nkv: int, d: int, bs: int, dt: str) -> KernelCall:
    context = [1, 37, 300, 129]
    table, kc, vc, q = kit.paged_inputs(
        (41, 42, 43, 44), context, len(context), n=n, nkv=nkv, d=d, bs=bs, dtype=kit.dtype_of(dt), device=device
    )
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, out=torch.zeros_like(q))
    return KernelCall((q, kc, vc, table, context), kw, kit.out_kwarg)


def _decode_window(device: Any, *, n: int, nkv: int, w: int, dt: str) -> KernelCall:
    d, bs, context = 128, 128, [1, 37, 300, 129]
    table, kc, vc, q = kit.paged_inputs(
        (49, 42, 43, 44), context, len(context), n=n, nkv=nkv, d=d, bs=bs, dtype=kit.dtype_of(dt), device=device
    )
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, sliding_window=w, out=torch.zeros_like(q))
    return KernelCall((q, kc, vc, table, lens, context), kw, kit.out_kwarg)


def _graph_decode(device: Any, *, n: int, nkv: int, d: int, w: int | None, dt: str) -> KernelCall:
    # A compiled decode graph of 4 requests, the last one padding (block-table row 0, length 2)
    context = [37, 300, 129, 2]
    table, kc, vc, q = kit.paged_inputs(
        (45, 42, 43, 44), context, 4, n=n, nkv=nkv, d=d, bs=128, dtype=kit.dtype_of(dt), device=device
    )
    table[3] = 0
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, sliding_window=w, out=torch.zeros_like(q))
    return KernelCall((q, kc, vc, table, lens, context), kw, kit.out_kwarg)


def _graph_kv_write(device: Any, *, nkv: int, d: int, dt: str) -> KernelCall:
    seq_lens = [5, 130, 1]
    table, nb = kit.block_table(35, seq_lens, 128, device)
    slots = kit.slots(table, [(0, 4), (1, 129), (2, 0)], 128).to(device)
    slots = torch.cat([slots, slots.new_zeros(1)])  # a padding row on the null block's slot 0
    k_cache, v_cache = randn(36, 2, nb, 128, nkv, d, dtype=kit.dtype_of(dt), device=device).unbind(0)
    k, v = (
        randn(37, 4, nkv, d, dtype=kit.dtype_of(dt), device=device),
        randn(38, 4, nkv, d, dtype=kit.dtype_of(dt), device=device),
    )
    lens = torch.tensor([5, 130, 1, 2], dtype=torch.int32, device=device)
    return KernelCall((k, v, k_cache, v_cache, slots, lens), {}, _caches_out)


_PREFILL_BATCHES = {
    "mixed": ([1, 7, 40, 2], [33, 7, 300, 129]),  # decode, first prefill, chunked prefill, spec-decode
    "decode-only": ([1, 1, 1], [5, 260, 41]),
}


def _paged_prefill(device: Any, *, n: int, nkv: int, d: int, w: int | None, batch: str, dt: str) -> KernelCall:
    q_lens, seq_lens = _PREFILL_BATCHES[batch]
    table, kc, vc, q = kit.paged_inputs(
        (45, 46, 47, 48), seq_lens, sum(q_lens), n=n, nkv=nkv, d=d, bs=128, dtype=kit.dtype_of(dt), device=device
    )
    mask = AttentionMaskBuilder(device).splitfuse_mask()
    kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, attn_mask=mask, out=torch.zeros_like(q), sliding_window=w)
    return KernelCall((q, kc, vc, table, list(accumulate(q_lens, initial=0)), seq_lens), kw, kit.out_kwarg)


# The parameter tables: one row per shape (the builder's keywords), each crossed with HALVES.
_CACHE_WRITE_SHAPES = ({"nkv": 8, "d": 128, "bs": 128}, {"nkv": 2, "d": 64, "bs": 16})
_PACKED_SHAPES = ({"n": 32, "nkv": 8, "d": 128}, {"n": 8, "nkv": 2, "d": 64})
# Qwen2.5-VL's 16 heads of 80; Qwen3-VL's (and SigLIP so400m's: Gemma-3, MiniCPM-V) 16 of 72; the Whisper-large
# audio encoders' 20 of 64 (Qwen2-Audio, Qwen2.5-Omni; npu-models' encoder seam)
_VISION_SHAPES = ({"n": 16, "d": 80}, {"n": 16, "d": 72}, {"n": 20, "d": 64})
_DECODE_SHAPES = ({"n": 32, "nkv": 8, "d": 128, "bs": 128}, {"n": 8, "nkv": 1, "d": 64, "bs": 16})
_WINDOW_SHAPES = ({"n": 32, "nkv": 8, "w": 16}, {"n": 16, "nkv": 2, "w": 100})
_GRAPH_SHAPES = (((32, 8, 128), None), ((16, 2, 128), 16))  # ((N, Nkv, D), window)
_PREFILL_SHAPES = (  # ((N, Nkv, D), window, batch)
    ((32, 8, 128), None, "mixed"),
    ((16, 2, 128), 16, "mixed"),
    ((16, 2, 128), 16, "decode-only"),
    ((8, 8, 64), None, "decode-only"),
)
_ENCODER = "q [34, {n}, {d}] kv heads {nkv}, seqs [4, 21, 9]"


def _packed_cases() -> list[KernelCase]:
    """The kernels over the batch's own keys: cache write, first prefill, encoder-only and the vision towers."""
    return [
        *grid(
            _CACHE_WRITE_SHAPES,
            Spec(RESHAPE_AND_CACHE, "k/v [6, {nkv}, {d}] -> cache [nb, {bs}, {nkv}, {d}]", _cache_write, "audit #1"),
        ),
        *grid(
            _PACKED_SHAPES,
            Spec(
                PREFILL_NO_CACHE, "q [60, {n}, {d}] kv heads {nkv}, seqs [3, 17, 40]", _prefill_no_cache, "audit #2, #7"
            ),
            Spec(ENCODER_ATTENTION, _ENCODER, partial(_encoder, w=None), "audit #3"),
            Spec(ENCODER_ATTENTION, _ENCODER + ", window 8", partial(_encoder, w=8), "audit #3"),
        ),
        *grid(_VISION_SHAPES, Spec(VISION_ATTENTION, "q [332, {n}, {d}], seqs [64, 196, 36, 36]", _vision)),
    ]


def _decode_cases() -> list[KernelCase]:
    """One query token per request: the paged decode, its sliding-window form and the compiled graph's pair."""
    cases = [
        *grid(
            _DECODE_SHAPES,
            Spec(
                PAGED_DECODE,
                "q [4, {n}, {d}] kv heads {nkv}, block {bs}, ctx [1, 37, 300, 129]",
                _paged_decode,
                "audit #4",
            ),
        ),
        *grid(
            _WINDOW_SHAPES,
            Spec(
                PAGED_DECODE_WINDOW,
                "q [4, {n}, 128] kv heads {nkv}, block 128, ctx [1, 37, 300, 129], window {w}",
                _decode_window,
                "audit #6 (decode)",
            ),
        ),
    ]
    for (n, nkv, d), w in _GRAPH_SHAPES:
        for dt in HALVES:
            label = f"q [4, {n}, {d}] kv heads {nkv}, block 128, lens [37, 300, 129, pad 2], window {w}"
            graph = partial(_graph_decode, n=n, nkv=nkv, d=d, w=w, dt=dt)
            cases.append(KernelCase(GRAPH_DECODE, label, dt, graph, note="torchair graph decode"))
            if w is None:
                label = f"k/v [4, {nkv}, {d}] -> cache [nb, 128, {nkv}, {d}], a padding slot 0"
                write = partial(_graph_kv_write, nkv=nkv, d=d, dt=dt)
                cases.append(KernelCase(GRAPH_KV_WRITE, label, dt, write, note="torchair graph KV write"))
    return cases


def _prefill_note(window: int | None, batch: str) -> str:
    if not window:
        return "audit #5"
    return "audit #5, #6 (window on decode)" if batch == "decode-only" else "audit #5, #6"


def _paged_prefill_cases() -> list[KernelCase]:
    """Any number of query tokens per request over the paged cache (FIA, TND)."""
    cases = []
    for (n, nkv, d), window, batch in _PREFILL_SHAPES:
        q_lens, seq_lens = _PREFILL_BATCHES[batch]
        label = f"{batch} q_lens {q_lens} seq_lens {seq_lens}, heads {n}/{nkv} x {d}" + (
            f", window {window}" if window else ""
        )
        for dt in HALVES:
            build = partial(_paged_prefill, n=n, nkv=nkv, d=d, w=window, batch=batch, dt=dt)
            cases.append(KernelCase(PAGED_PREFILL, label, dt, build, note=_prefill_note(window, batch)))
    return cases


def _gqa_cases() -> list[KernelCase]:
    return [*_packed_cases(), *_decode_cases(), *_paged_prefill_cases()]


def _sorted_selection(result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """The selected positions per query, sorted: with fewer candidates than ``topk`` every valid one is selected."""
    return {"selected": result.sort(dim=-1).values}


def _sfa_cases() -> list[KernelCase]:
    cases = []
    bs, topk, heads, d = 128, 2048, 64, 128
    q_lens, seq_lens = [3, 1, 6], [3, 200, 130]
    qsl = list(accumulate(q_lens, initial=0))
    t = sum(q_lens)
    for dtype in ("bfloat16",):

        def index_write(device: Any, dt: str = dtype) -> KernelCall:
            table, nb = kit.block_table(80, seq_lens, bs, device)
            slots = kit.slots(table, kit.new_token_positions(q_lens, seq_lens), bs)
            slots = torch.cat((slots, torch.tensor([-1]))).to(device)
            cache = randn(81, nb, bs, d, dtype=kit.dtype_of(dt), device=device)
            return KernelCall(
                (randn(82, slots.numel(), d, dtype=kit.dtype_of(dt), device=device), cache, slots),
                {},
                lambda r, a, kw: {"cache[1:]": a[1][1:]},
            )

        def indexer(device: Any, dt: str = dtype) -> KernelCall:
            table, nb = kit.block_table(83, seq_lens, bs, device)
            cache = randn(84, nb, bs, d, dtype=kit.dtype_of(dt), device=device)
            q = randn(85, t, heads, d, dtype=kit.dtype_of(dt), device=device)
            w = randn(86, t, heads, dtype=kit.dtype_of(dt), device=device, scale=0.1)
            return KernelCall((q, w, cache, table, qsl, seq_lens, topk), {}, _sorted_selection)

        def sparse(device: Any, dt: str = dtype) -> KernelCall:
            n = 32
            table, nb = kit.block_table(87, seq_lens, bs, device)
            nope, rope = kit.latent_planes(88, nb, bs, kit.dtype_of(dt), device)
            pos = [p for _, p in kit.new_token_positions(q_lens, seq_lens)]
            idx = torch.full((t, topk), -1, dtype=torch.int32)
            for row, p in enumerate(pos):  # a causal selection of up to 64 earlier positions per token
                chosen = randperm(89 + row, p + 1, "cpu")[:64]
                idx[row, : chosen.numel()] = chosen.to(torch.int32)
            ql = randn(90, t, n, L, dtype=kit.dtype_of(dt), device=device)
            qpe = randn(91, t, n, R, dtype=kit.dtype_of(dt), device=device)
            return KernelCall((ql, qpe, nope, rope, idx.to(device), table, qsl, seq_lens, (P + R) ** -0.5), {})

        cases += [
            KernelCase(
                INDEXER_CACHE_WRITE, f"k [11, {d}] (1 pad) -> [nb, {bs}, {d}]", dtype, index_write, note="audit #16"
            ),
            KernelCase(
                LIGHTNING_INDEXER, f"q [10, {heads}, {d}] seqs {seq_lens} top{topk}", dtype, indexer, note="audit #17"
            ),
            KernelCase(
                SPARSE_MLA_ATTENTION,
                f"ql_nope [10, 32, {L}] 64 of top{topk}, seqs {seq_lens}",
                dtype,
                sparse,
                note="audit #18",
            ),
        ]
    return cases


def selftest_cases() -> list[KernelCase]:
    """Every attention kernel pair over its grid of shapes and dtypes. On an Ascend 310P only its own GQA kernels
    (the A2/A3 rows use bfloat16, FIA and MLA kernels the chip does not run); elsewhere the 310P rows run on the
    emulated device and are skipped on an A2/A3 NPU (:mod:`._selftest_310p`)."""
    from ._selftest_310p import cases_310p

    if is_310p():
        return cases_310p()
    return [*_gqa_cases(), *c8_cases(), *mla_cases(), *_sfa_cases(), *cases_310p()]
