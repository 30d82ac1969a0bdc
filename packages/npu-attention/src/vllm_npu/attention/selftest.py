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

import math
from itertools import accumulate
from typing import Any

import torch
from vllm_npu.interface.selftest import KernelCall, KernelCase, randn, randperm

from .masks import AttentionMaskBuilder
from .ops.flash_attention import ENCODER_ATTENTION, PREFILL_NO_CACHE
from .ops.graph_decode import GRAPH_DECODE, GRAPH_KV_WRITE, MLA_GRAPH_DECODE
from .ops.kv_cache import RESHAPE_AND_CACHE
from .ops.mla_attention import MLA_DECODE, MLA_SPEC_DECODE, RING_MLA, mla_decode_workspace_npu, ring_mla_mask
from .ops.mla_cache import KV_RMSNORM_ROPE_CACHE, MLA_CACHE_WRITE, PAGED_CACHE_LOAD, latent_cache_planes
from .ops.mla_layer import INTERLEAVE_ROPE
from .ops.paged_attention import PAGED_DECODE, PAGED_DECODE_WINDOW, PAGED_PREFILL
from .ops.sfa_kernels import INDEXER_CACHE_WRITE, LIGHTNING_INDEXER, SPARSE_MLA_ATTENTION
from .ops.vision_attention import VISION_ATTENTION
from .ops.weight_format import WEIGHT_TO_ND

HALVES = ("bfloat16", "float16")
L, R, P, V = 512, 64, 128, 128  # DeepSeek MLA: kv_lora_rank, rope, qk_nope_head_dim, v_head_dim


def _dt(name: str) -> torch.dtype:
    return getattr(torch, name)


def _block_table(seed: int, seq_lens: list[int], block_size: int, device: Any) -> tuple[torch.Tensor, int]:
    """``(block_table [B, max_blocks] int32, num_blocks)``: distinct shuffled blocks >= 1 per request, 0-padded."""
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need) + 2  # the null block 0 and one never used
    blocks = (randperm(seed, num_blocks - 1, "cpu") + 1).tolist()
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(blocks[start : start + n], dtype=torch.int32)
        start += n
    return table.to(device), num_blocks


def _slots(table: torch.Tensor, positions: list[tuple[int, int]], block_size: int) -> torch.Tensor:
    """Slots ``[T]`` int64 of ``(request, position)`` pairs through ``table``."""
    cpu = table.cpu()
    return torch.tensor([int(cpu[b, p // block_size]) * block_size + p % block_size for b, p in positions])


def _paged_inputs(
    seeds: tuple[int, int, int, int],
    seq_lens: list[int],
    num_tokens: int,
    *,
    n: int,
    nkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    device: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(block_table, key_cache, value_cache, query)`` for a paged case: caches ``[nb, bs, nkv, d]`` and query
    ``[num_tokens, n, d]``, drawn from ``seeds`` (table, K, V, query) in that order."""
    table, nb = _block_table(seeds[0], seq_lens, bs, device)
    kc = randn(seeds[1], nb, bs, nkv, d, dtype=dtype, device=device)
    vc = randn(seeds[2], nb, bs, nkv, d, dtype=dtype, device=device)
    q = randn(seeds[3], num_tokens, n, d, dtype=dtype, device=device)
    return table, kc, vc, q


def _new_token_positions(q_lens: list[int], seq_lens: list[int]) -> list[tuple[int, int]]:
    return [(b, s - q + i) for b, (q, s) in enumerate(zip(q_lens, seq_lens)) for i in range(q)]


def _out(result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    return {"out": kwargs["out"]}


# --- GQA ------------------------------------------------------------------------------------------------------------


def _gqa_cases() -> list[KernelCase]:
    cases = []
    for nkv, d, bs in ((8, 128, 128), (2, 64, 16)):
        for dtype in HALVES:

            def write(device: Any, nkv: int = nkv, d: int = d, bs: int = bs, dt: str = dtype) -> KernelCall:
                seq_lens = [5, 130, 1]
                table, nb = _block_table(30, seq_lens, bs, device)
                slots = _slots(table, _new_token_positions([3, 2, 1], seq_lens), bs).to(torch.int32).to(device)
                t = slots.numel()
                # one (2, nb, bs, Nkv, D) buffer unbound into K and V, as the GQA backend does; untouched slots stay
                k_cache, v_cache = randn(31, 2, nb, bs, nkv, d, dtype=_dt(dt), device=device).unbind(0)
                k, v = (
                    randn(33, t, nkv, d, dtype=_dt(dt), device=device),
                    randn(34, t, nkv, d, dtype=_dt(dt), device=device),
                )
                return KernelCall(
                    (k, v, k_cache, v_cache, slots), {}, lambda r, a, kw: {"key_cache": a[2], "value_cache": a[3]}
                )

            cases.append(
                KernelCase(
                    RESHAPE_AND_CACHE,
                    f"k/v [6, {nkv}, {d}] -> cache [nb, {bs}, {nkv}, {d}]",
                    dtype,
                    write,
                    note="audit #1",
                )
            )

    for n, nkv, d in ((32, 8, 128), (8, 2, 64)):
        for dtype in HALVES:

            def prefill(device: Any, n: int = n, nkv: int = nkv, d: int = d, dt: str = dtype) -> KernelCall:
                seq_lens = [3, 17, 40]
                t = sum(seq_lens)
                mask = AttentionMaskBuilder(device).causal_mask(max(seq_lens), _dt(dt))
                q, k, v = (randn(35 + i, t, h, d, dtype=_dt(dt), device=device) for i, h in enumerate((n, nkv, nkv)))
                kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, attn_mask=mask, out=torch.zeros_like(q))
                return KernelCall((q, k, v, seq_lens), kw, _out)

            cases.append(
                KernelCase(
                    PREFILL_NO_CACHE,
                    f"q [60, {n}, {d}] kv heads {nkv}, seqs [3, 17, 40]",
                    dtype,
                    prefill,
                    note="audit #2, #7",
                )
            )
            for window in (None, 8):

                def encoder(
                    device: Any, n: int = n, nkv: int = nkv, d: int = d, dt: str = dtype, w: int | None = window
                ):
                    seq_lens = [4, 21, 9]
                    t = sum(seq_lens)
                    q, k, v = (
                        randn(38 + i, t, h, d, dtype=_dt(dt), device=device) for i, h in enumerate((n, nkv, nkv))
                    )
                    mask = AttentionMaskBuilder(device).pooling_mask()
                    kw = dict(
                        num_heads=n,
                        num_kv_heads=nkv,
                        scale=d**-0.5,
                        attn_mask=mask,
                        out=torch.zeros_like(q),
                        sliding_window=w,
                    )
                    return KernelCall((q, k, v, list(accumulate(seq_lens, initial=0)), max(seq_lens)), kw, _out)

                label = f"q [34, {n}, {d}] kv heads {nkv}, seqs [4, 21, 9]" + (f", window {window}" if window else "")
                cases.append(KernelCase(ENCODER_ATTENTION, label, dtype, encoder, note="audit #3"))

    # Vision towers: Qwen2.5-VL's 16 heads of 80, Qwen3-VL's 16 of 72; two images, two frames of a video.
    for n, d in ((16, 80), (16, 72)):
        for dtype in HALVES:

            def vision(device: Any, n: int = n, d: int = d, dt: str = dtype) -> KernelCall:
                seq_lens = [64, 196, 36, 36]
                q, k, v = (randn(60 + i, sum(seq_lens), n, d, dtype=_dt(dt), device=device) for i in range(3))
                lens = torch.tensor(seq_lens, dtype=torch.int32)  # on the host, as the kernel reads it
                kw = dict(num_heads=n, num_kv_heads=n, scale=d**-0.5, out=torch.zeros_like(q))
                return KernelCall((q, k, v, lens), kw, _out)

            cases.append(KernelCase(VISION_ATTENTION, f"q [332, {n}, {d}], seqs [64, 196, 36, 36]", dtype, vision))

    for n, nkv, d, bs in ((32, 8, 128, 128), (8, 1, 64, 16)):
        for dtype in HALVES:

            def decode(
                device: Any, n: int = n, nkv: int = nkv, d: int = d, bs: int = bs, dt: str = dtype
            ) -> KernelCall:
                context = [1, 37, 300, 129]
                table, kc, vc, q = _paged_inputs(
                    (41, 42, 43, 44), context, len(context), n=n, nkv=nkv, d=d, bs=bs, dtype=_dt(dt), device=device
                )
                kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, out=torch.zeros_like(q))
                return KernelCall((q, kc, vc, table, context), kw, _out)

            cases.append(
                KernelCase(
                    PAGED_DECODE,
                    f"q [4, {n}, {d}] kv heads {nkv}, block {bs}, ctx [1, 37, 300, 129]",
                    dtype,
                    decode,
                    note="audit #4",
                )
            )

    for n, nkv, window in ((32, 8, 16), (16, 2, 100)):
        for dtype in HALVES:

            def decode_window(device: Any, n: int = n, nkv: int = nkv, w: int = window, dt: str = dtype) -> KernelCall:
                d, bs, context = 128, 128, [1, 37, 300, 129]
                table, kc, vc, q = _paged_inputs(
                    (49, 42, 43, 44), context, len(context), n=n, nkv=nkv, d=d, bs=bs, dtype=_dt(dt), device=device
                )
                lens = torch.tensor(context, dtype=torch.int32, device=device)
                kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, sliding_window=w, out=torch.zeros_like(q))
                return KernelCall((q, kc, vc, table, lens, context), kw, _out)

            cases.append(
                KernelCase(
                    PAGED_DECODE_WINDOW,
                    f"q [4, {n}, 128] kv heads {nkv}, block 128, ctx [1, 37, 300, 129], window {window}",
                    dtype,
                    decode_window,
                    note="audit #6 (decode)",
                ),
            )

    for (n, nkv, d), window in (((32, 8, 128), None), ((16, 2, 128), 16)):
        for dtype in HALVES:

            def graph(
                device: Any, n: int = n, nkv: int = nkv, d: int = d, w: int | None = window, dt: str = dtype
            ) -> KernelCall:
                # A compiled decode graph of 4 requests, the last one padding (block-table row 0, length 2)
                context = [37, 300, 129, 2]
                table, kc, vc, q = _paged_inputs(
                    (45, 42, 43, 44), context, 4, n=n, nkv=nkv, d=d, bs=128, dtype=_dt(dt), device=device
                )
                table[3] = 0
                lens = torch.tensor(context, dtype=torch.int32, device=device)
                kw = dict(num_heads=n, num_kv_heads=nkv, scale=d**-0.5, sliding_window=w, out=torch.zeros_like(q))
                return KernelCall((q, kc, vc, table, lens, context), kw, _out)

            label = f"q [4, {n}, {d}] kv heads {nkv}, block 128, lens [37, 300, 129, pad 2], window {window}"
            cases.append(KernelCase(GRAPH_DECODE, label, dtype, graph, note="torchair graph decode"))

            def graph_write(device: Any, nkv: int = nkv, d: int = d, dt: str = dtype) -> KernelCall:
                seq_lens = [5, 130, 1]
                table, nb = _block_table(35, seq_lens, 128, device)
                slots = _slots(table, [(0, 4), (1, 129), (2, 0)], 128).to(device)
                slots = torch.cat([slots, slots.new_zeros(1)])  # a padding row on the null block's slot 0
                k_cache, v_cache = randn(36, 2, nb, 128, nkv, d, dtype=_dt(dt), device=device).unbind(0)
                k, v = (
                    randn(37, 4, nkv, d, dtype=_dt(dt), device=device),
                    randn(38, 4, nkv, d, dtype=_dt(dt), device=device),
                )
                lens = torch.tensor([5, 130, 1, 2], dtype=torch.int32, device=device)
                return KernelCall(
                    (k, v, k_cache, v_cache, slots, lens), {}, lambda r, a, kw: {"key_cache": a[2], "value_cache": a[3]}
                )

            if window is None:
                label = f"k/v [4, {nkv}, {d}] -> cache [nb, 128, {nkv}, {d}], a padding slot 0"
                cases.append(KernelCase(GRAPH_KV_WRITE, label, dtype, graph_write, note="torchair graph KV write"))

    batches = {
        "mixed": ([1, 7, 40, 2], [33, 7, 300, 129]),  # decode, first prefill, chunked prefill, spec-decode
        "decode-only": ([1, 1, 1], [5, 260, 41]),
    }
    for (n, nkv, d), window, batch in (
        ((32, 8, 128), None, "mixed"),
        ((16, 2, 128), 16, "mixed"),
        ((16, 2, 128), 16, "decode-only"),
        ((8, 8, 64), None, "decode-only"),
    ):
        for dtype in HALVES:

            def prefill_paged(
                device: Any,
                n: int = n,
                nkv: int = nkv,
                d: int = d,
                w: int | None = window,
                batch: str = batch,
                dt: str = dtype,
            ):
                q_lens, seq_lens = batches[batch]
                table, kc, vc, q = _paged_inputs(
                    (45, 46, 47, 48), seq_lens, sum(q_lens), n=n, nkv=nkv, d=d, bs=128, dtype=_dt(dt), device=device
                )
                mask = AttentionMaskBuilder(device).splitfuse_mask()
                kw = dict(
                    num_heads=n,
                    num_kv_heads=nkv,
                    scale=d**-0.5,
                    attn_mask=mask,
                    out=torch.zeros_like(q),
                    sliding_window=w,
                )
                return KernelCall((q, kc, vc, table, list(accumulate(q_lens, initial=0)), seq_lens), kw, _out)

            q_lens, seq_lens = batches[batch]
            label = f"{batch} q_lens {q_lens} seq_lens {seq_lens}, heads {n}/{nkv} x {d}" + (
                f", window {window}" if window else ""
            )
            note = "audit #5" + (
                ", #6 (window on decode)" if window and batch == "decode-only" else ", #6" if window else ""
            )
            cases.append(KernelCase(PAGED_PREFILL, label, dtype, prefill_paged, note=note))
    return cases


# --- MLA ------------------------------------------------------------------------------------------------------------


def _latent_planes(seed: int, nb: int, bs: int, dtype: torch.dtype, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The nope/rope planes of one random ``[nb, bs, L + R]`` buffer (the layout the MLA backend allocates)."""
    return latent_cache_planes(randn(seed, nb, bs, L + R, dtype=dtype, device=device), L, R)


def _planes_out(nope_at: int, rope_at: int):
    """Outputs: the returned tensors and both cache planes past the null block 0 (padding slots land there on NPU)."""

    def outputs(result: Any, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
        out = {} if result is None else {f"out{i}": r for i, r in enumerate(result)}
        return {**out, "nope_cache[1:]": args[nope_at][1:], "rope_cache[1:]": args[rope_at][1:]}

    return outputs


def _cos_sin(seed: int, t: int, device: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    theta = randn(seed, t, R // 2, dtype=torch.float32, device="cpu", scale=3.0)
    cos, sin = theta.cos(), theta.sin()
    return torch.cat((cos, cos), -1).to(device=device, dtype=dtype), torch.cat((sin, sin), -1).to(
        device=device, dtype=dtype
    )


def _mla_cases() -> list[KernelCase]:
    cases = []
    for heads in (16, 128):
        for dtype in HALVES:

            def to_nd(device: Any, n: int = heads, dt: str = dtype) -> KernelCall:
                weight = randn(92, n * (P + V), L, dtype=_dt(dt), device=device, scale=0.05)  # kv_b_proj [N(P+V), L]
                x = randn(93, 3, L, dtype=_dt(dt), device=device)
                # the values must not change, and the split vLLM makes of the weight must read the same numbers
                return KernelCall(
                    (weight,),
                    {},
                    lambda w, a, k: {
                        "weight": w,
                        "W_UK | W_UV": w.T.reshape(L, n, P + V).contiguous(),
                        "x @ W^T": torch.nn.functional.linear(x, w),
                    },
                )

            cases.append(
                KernelCase(WEIGHT_TO_ND, f"kv_b_proj [{heads}*({P}+{V}), {L}]", dtype, to_nd, note="audit #27")
            )
    for n, bs, graph in ((32, 128, False), (128, 16, False), (64, 128, False), (32, 16, True)):
        for dtype in HALVES:

            def decode(device: Any, n: int = n, bs: int = bs, dt: str = dtype, graph: bool = graph) -> KernelCall:
                seq_lens = [1, 150, 37]
                table, nb = _block_table(50, seq_lens, bs, device)
                nope, rope = _latent_planes(51, nb, bs, _dt(dt), device)
                b = len(seq_lens)
                ql = randn(52, b, n, L, dtype=_dt(dt), device=device)
                qpe = randn(53, b, n, R, dtype=_dt(dt), device=device)
                args = (ql, qpe, nope, rope, table, seq_lens, (P + R) ** -0.5)
                kwargs: dict[str, Any] = {"out": torch.empty_like(ql)}
                if graph and torch.device(device).type == "npu":
                    # the full-graph call: max workspace and a softmax_lse buffer passed in (the reference ignores both)
                    kwargs.update(workspace=mla_decode_workspace_npu(*args), lse=ql.new_empty(b))
                return KernelCall(args, kwargs, lambda r, a, k: {"out": k["out"]})

            cases.append(
                KernelCase(
                    MLA_DECODE,
                    f"ql_nope [3, {n}, {L}] q_pe [3, {n}, {R}], block {bs}, seqs [1, 150, 37]"
                    + (", max workspace (graph task)" if graph else ""),
                    dtype,
                    decode,
                    note="audit #9, #15" + (", graph-task form of the call" if graph else ""),
                )
            )

    for n, bs in ((32, 128), (128, 16)):
        for dtype in HALVES:

            def graph_decode(device: Any, n: int = n, bs: int = bs, dt: str = dtype) -> KernelCall:
                # a compiled decode graph of 4 requests, the last one padding (block-table row 0, length 2)
                seq_lens = [150, 37, 129, 2]
                table, nb = _block_table(70, seq_lens, bs, device)
                table[3] = 0
                nope, rope = _latent_planes(71, nb, bs, _dt(dt), device)
                ql, qpe = (randn(s, 4, n, w, dtype=_dt(dt), device=device) for s, w in ((72, L), (73, R)))
                lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
                return KernelCall((ql, qpe, nope, rope, table, lens, seq_lens, (P + R) ** -0.5), {})

            label = f"ql_nope [4, {n}, {L}] q_pe [4, {n}, {R}], block {bs}, lens [150, 37, 129, pad 2]"
            cases.append(KernelCase(MLA_GRAPH_DECODE, label, dtype, graph_decode, note="torchair graph decode (MLA)"))

            def graph_write(device: Any, bs: int = bs, dt: str = dtype) -> KernelCall:
                table, nb = _block_table(74, [5, 130, 1], bs, device)
                slots = torch.cat([_slots(table, [(0, 4), (1, 129), (2, 0)], bs), torch.zeros(1, dtype=torch.long)])
                nope, rope = _latent_planes(75, nb, bs, _dt(dt), device)
                kv_c, k_pe = (randn(s, 4, 1, w, dtype=_dt(dt), device=device) for s, w in ((76, L), (77, R)))
                lens = torch.tensor([5, 130, 1, 2], dtype=torch.int32, device=device)
                args = (kv_c, k_pe, nope, rope, slots.to(device), lens)
                return KernelCall(args, {}, lambda r, a, k: {"seq_lens": r, "nope[1:]": a[2][1:], "rope[1:]": a[3][1:]})

            label = f"kv_c [4, 1, {L}] k_pe [4, 1, {R}] -> latent planes, block {bs}, a padding slot 0"
            cases.append(KernelCase(GRAPH_KV_WRITE, label, dtype, graph_write, note="torchair graph latent write"))

    for n, bs in ((32, 128), (128, 16)):
        for dtype in HALVES:

            def spec_decode(device: Any, n: int = n, bs: int = bs, dt: str = dtype) -> KernelCall:
                # mixed draft windows (1..4 query tokens), one crossing a block boundary, one short prompt
                query_lens, seq_lens = [4, 1, 3, 2], [150, 37, 130, 2]
                table, nb = _block_table(66, seq_lens, bs, device)
                nope, rope = _latent_planes(67, nb, bs, _dt(dt), device)
                t = sum(query_lens)
                ql = randn(68, t, n, L, dtype=_dt(dt), device=device)
                qpe = randn(69, t, n, R, dtype=_dt(dt), device=device)
                mask = AttentionMaskBuilder(device).splitfuse_mask()
                args = (ql, qpe, nope, rope, table, query_lens, seq_lens, (P + R) ** -0.5)
                return KernelCall(args, {"attn_mask": mask})

            cases.append(
                KernelCase(
                    MLA_SPEC_DECODE,
                    f"ql_nope [10, {n}, {L}] q_pe [10, {n}, {R}], block {bs}, query lens [4, 1, 3, 2]",
                    dtype,
                    spec_decode,
                    note="issue #15",
                )
            )

    for n in (16, 32):
        for dtype in HALVES:

            def first_ring(device: Any, n: int = n, dt: str = dtype) -> KernelCall:
                q_lens = kv_lens = [5, 70, 1]
                t = sum(q_lens)
                args = (
                    randn(54, t, n, P, dtype=_dt(dt), device=device),
                    randn(55, t, n, R, dtype=_dt(dt), device=device),
                    randn(56, t, n, P, dtype=_dt(dt), device=device),
                    randn(57, t, 1, R, dtype=_dt(dt), device=device),
                    randn(58, t, n, V, dtype=_dt(dt), device=device),
                    q_lens,
                    kv_lens,
                    (P + R) ** -0.5,
                    True,
                )
                return KernelCall(args, {"mask": ring_mla_mask(_dt(dt), device)})

            def context_ring(device: Any, n: int = n, dt: str = dtype) -> KernelCall:
                q_lens, kv_lens = [5, 70, 1], [128, 300, 0]
                t, s = sum(q_lens), sum(kv_lens)
                prev_out = randn(59, t, n, V, dtype=_dt(dt), device=device)
                prev_lse = randn(60, n, t, dtype=torch.float32, device=device, scale=2.0)
                args = (
                    randn(61, t, n, P, dtype=_dt(dt), device=device),
                    randn(62, t, n, R, dtype=_dt(dt), device=device),
                    randn(63, s, n, P, dtype=_dt(dt), device=device),
                    randn(64, s, 1, R, dtype=_dt(dt), device=device),
                    randn(65, s, n, V, dtype=_dt(dt), device=device),
                    q_lens,
                    kv_lens,
                    (P + R) ** -0.5,
                    False,
                    prev_out,
                    prev_lse,
                )
                return KernelCall(args, {"mask": None})

            cases += [
                KernelCase(
                    RING_MLA, f"first ring, causal, q=kv [5, 70, 1], heads {n}", dtype, first_ring, note="audit #10"
                ),
                KernelCase(
                    RING_MLA, f"context ring + merge, q [5, 70, 1] kv [128, 300, 0], heads {n}", dtype, context_ring
                ),
            ]

    for bs in (128, 16):
        for dtype in HALVES:

            def cache_write(device: Any, bs: int = bs, dt: str = dtype) -> KernelCall:
                seq_lens = [3, 140]
                table, nb = _block_table(66, seq_lens, bs, device)
                slots = _slots(table, _new_token_positions([3, 4], seq_lens), bs)
                slots = torch.cat((slots, torch.tensor([-1]))).to(device)  # one padding slot
                nope, rope = _latent_planes(67, nb, bs, _dt(dt), device)
                t = slots.numel()
                args = (
                    randn(68, t, L, dtype=_dt(dt), device=device),
                    randn(69, t, R, dtype=_dt(dt), device=device),
                    nope,
                    rope,
                    slots,
                )
                return KernelCall(args, {}, _planes_out(2, 3))

            def fused_write(device: Any, bs: int = bs, dt: str = dtype) -> KernelCall:
                seq_lens = [3, 140]
                table, nb = _block_table(70, seq_lens, bs, device)
                slots = _slots(table, _new_token_positions([3, 4], seq_lens), bs).to(device)
                nope, rope = _latent_planes(71, nb, bs, _dt(dt), device)
                t = slots.numel()
                cos, sin = _cos_sin(72, t, device, _dt(dt))
                gamma = randn(73, L, dtype=_dt(dt), device=device, scale=0.1) + 1
                args = (randn(74, t, L + R, dtype=_dt(dt), device=device), gamma, cos, sin, slots, nope, rope, 1e-6)
                return KernelCall(args, {}, _planes_out(5, 6))

            def load(device: Any, bs: int = bs, dt: str = dtype) -> KernelCall:
                seq_lens = [300, 5, 129]
                table, nb = _block_table(75, seq_lens, bs, device)
                nope, rope = _latent_planes(76, nb, bs, _dt(dt), device)
                lens = torch.tensor([128, 5, 1], dtype=torch.int32, device=device)
                starts = torch.tensor([128, 0, 128], dtype=torch.int32, device=device)
                return KernelCall(
                    (nope, rope, table, lens, starts), {"total": 134}
                )  # host-known, as the backend passes

            cases += [
                KernelCase(
                    MLA_CACHE_WRITE,
                    f"kv_c [8, {L}] k_pe [8, {R}] (1 pad) -> block {bs}",
                    dtype,
                    cache_write,
                    note="audit #14, #15",
                ),
                KernelCase(
                    KV_RMSNORM_ROPE_CACHE, f"kv [7, {L}+{R}] -> block {bs}", dtype, fused_write, note="audit #12"
                ),
                KernelCase(
                    PAGED_CACHE_LOAD, f"block {bs}, chunks [128@128, 5@0, 1@128]", dtype, load, note="audit #11"
                ),
            ]

    for n in (16, 128):
        for dtype in HALVES:

            def rope(device: Any, n: int = n, dt: str = dtype) -> KernelCall:
                t = 9
                cos, sin = _cos_sin(77, t, device, _dt(dt))
                return KernelCall((randn(78, t, n, R, dtype=_dt(dt), device=device), cos[:, None], sin[:, None]), {})

            cases.append(KernelCase(INTERLEAVE_ROPE, f"q_pe [9, {n}, {R}]", dtype, rope, note="audit #13"))
    return cases


# --- SFA (DeepSeek-V3.2) ----------------------------------------------------------------------------------------------


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
            table, nb = _block_table(80, seq_lens, bs, device)
            slots = _slots(table, _new_token_positions(q_lens, seq_lens), bs)
            slots = torch.cat((slots, torch.tensor([-1]))).to(device)
            cache = randn(81, nb, bs, d, dtype=_dt(dt), device=device)
            return KernelCall(
                (randn(82, slots.numel(), d, dtype=_dt(dt), device=device), cache, slots),
                {},
                lambda r, a, kw: {"cache[1:]": a[1][1:]},
            )

        def indexer(device: Any, dt: str = dtype) -> KernelCall:
            table, nb = _block_table(83, seq_lens, bs, device)
            cache = randn(84, nb, bs, d, dtype=_dt(dt), device=device)
            q = randn(85, t, heads, d, dtype=_dt(dt), device=device)
            w = randn(86, t, heads, dtype=_dt(dt), device=device, scale=0.1)
            return KernelCall((q, w, cache, table, qsl, seq_lens, topk), {}, _sorted_selection)

        def sparse(device: Any, dt: str = dtype) -> KernelCall:
            n = 32
            table, nb = _block_table(87, seq_lens, bs, device)
            nope, rope = _latent_planes(88, nb, bs, _dt(dt), device)
            pos = [p for _, p in _new_token_positions(q_lens, seq_lens)]
            idx = torch.full((t, topk), -1, dtype=torch.int32)
            for row, p in enumerate(pos):  # a causal selection of up to 64 earlier positions per token
                chosen = randperm(89 + row, p + 1, "cpu")[:64]
                idx[row, : chosen.numel()] = chosen.to(torch.int32)
            ql = randn(90, t, n, L, dtype=_dt(dt), device=device)
            qpe = randn(91, t, n, R, dtype=_dt(dt), device=device)
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
    """Every attention kernel pair over its grid of shapes and dtypes."""
    return [*_gqa_cases(), *_mla_cases(), *_sfa_cases()]
