# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu selftest`` cases for the MLA kernel pairs (DeepSeek-V2/V3 sizes: kv_lora_rank 512, rope 64, qk_nope 128,
v_head 128; 16 and 128 local heads; block size 16 or 128); collected by :func:`.selftest.selftest_cases`."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from vllm_npu.interface import KernelCall, KernelCase, randn

from . import _selftest_kit as kit
from ._selftest_kit import HALVES, L, P, R, Spec, V, grid
from .masks import AttentionMaskBuilder
from .ops.graph_decode import GRAPH_KV_WRITE, MLA_GRAPH_DECODE
from .ops.mla_attention import MLA_DECODE, MLA_SPEC_DECODE, RING_MLA, mla_decode_workspace_npu, ring_mla_mask
from .ops.mla_cache import KV_RMSNORM_ROPE_CACHE, MLA_CACHE_WRITE, PAGED_CACHE_LOAD
from .ops.mla_layer import INTERLEAVE_ROPE
from .ops.weight_format import WEIGHT_TO_ND


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


# --- one builder per kernel, called through functools.partial with a row of its parameter table ---------------------


def _to_nd(device: Any, *, n: int, dt: str) -> KernelCall:
    weight = randn(92, n * (P + V), L, dtype=kit.dtype_of(dt), device=device, scale=0.05)  # kv_b_proj [N(P+V), L]
    x = randn(93, 3, L, dtype=kit.dtype_of(dt), device=device)
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


def _decode(device: Any, *, n: int, bs: int, dt: str, graph: bool) -> KernelCall:
    seq_lens = [1, 150, 37]
    table, nb = kit.block_table(50, seq_lens, bs, device)
    nope, rope = kit.latent_planes(51, nb, bs, kit.dtype_of(dt), device)
    b = len(seq_lens)
    ql = randn(52, b, n, L, dtype=kit.dtype_of(dt), device=device)
    qpe = randn(53, b, n, R, dtype=kit.dtype_of(dt), device=device)
    args = (ql, qpe, nope, rope, table, seq_lens, (P + R) ** -0.5)
    kwargs: dict[str, Any] = {"out": torch.empty_like(ql)}
    if graph and torch.device(device).type == "npu":
        # the full-graph call: max workspace and a softmax_lse buffer passed in (the reference ignores both)
        kwargs.update(workspace=mla_decode_workspace_npu(*args), lse=ql.new_empty(b))
    return KernelCall(args, kwargs, lambda r, a, k: {"out": k["out"]})


def _graph_decode(device: Any, *, n: int, bs: int, dt: str) -> KernelCall:
    # a compiled decode graph of 4 requests, the last one padding (block-table row 0, length 2)
    seq_lens = [150, 37, 129, 2]
    table, nb = kit.block_table(70, seq_lens, bs, device)
    table[3] = 0
    nope, rope = kit.latent_planes(71, nb, bs, kit.dtype_of(dt), device)
    ql, qpe = (randn(s, 4, n, w, dtype=kit.dtype_of(dt), device=device) for s, w in ((72, L), (73, R)))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return KernelCall((ql, qpe, nope, rope, table, lens, seq_lens, (P + R) ** -0.5), {})


def _graph_write(device: Any, *, bs: int, dt: str) -> KernelCall:
    table, nb = kit.block_table(74, [5, 130, 1], bs, device)
    slots = torch.cat([kit.slots(table, [(0, 4), (1, 129), (2, 0)], bs), torch.zeros(1, dtype=torch.long)])
    nope, rope = kit.latent_planes(75, nb, bs, kit.dtype_of(dt), device)
    kv_c, k_pe = (randn(s, 4, 1, w, dtype=kit.dtype_of(dt), device=device) for s, w in ((76, L), (77, R)))
    lens = torch.tensor([5, 130, 1, 2], dtype=torch.int32, device=device)
    args = (kv_c, k_pe, nope, rope, slots.to(device), lens)
    return KernelCall(args, {}, lambda r, a, k: {"seq_lens": r, "nope[1:]": a[2][1:], "rope[1:]": a[3][1:]})


def _spec_decode(device: Any, *, n: int, bs: int, dt: str) -> KernelCall:
    # mixed draft windows (1..4 query tokens), one crossing a block boundary, one short prompt
    query_lens, seq_lens = [4, 1, 3, 2], [150, 37, 130, 2]
    table, nb = kit.block_table(66, seq_lens, bs, device)
    nope, rope = kit.latent_planes(67, nb, bs, kit.dtype_of(dt), device)
    t = sum(query_lens)
    ql = randn(68, t, n, L, dtype=kit.dtype_of(dt), device=device)
    qpe = randn(69, t, n, R, dtype=kit.dtype_of(dt), device=device)
    mask = AttentionMaskBuilder(device).splitfuse_mask()
    args = (ql, qpe, nope, rope, table, query_lens, seq_lens, (P + R) ** -0.5)
    return KernelCall(args, {"attn_mask": mask})


def _first_ring(device: Any, *, n: int, dt: str) -> KernelCall:
    q_lens = kv_lens = [5, 70, 1]
    t = sum(q_lens)
    tensors = (
        randn(54 + i, t, h, w, dtype=kit.dtype_of(dt), device=device) for i, (h, w) in enumerate(_ring_widths(n))
    )
    args = (*tensors, q_lens, kv_lens, (P + R) ** -0.5, True)
    return KernelCall(args, {"mask": ring_mla_mask(kit.dtype_of(dt), device)})


def _context_ring(device: Any, *, n: int, dt: str) -> KernelCall:
    q_lens, kv_lens = [5, 70, 1], [128, 300, 0]
    t, s = sum(q_lens), sum(kv_lens)
    prev_out = randn(59, t, n, V, dtype=kit.dtype_of(dt), device=device)
    prev_lse = randn(60, n, t, dtype=torch.float32, device=device, scale=2.0)
    tokens = (t, t, s, s, s)  # q_nope, q_rope: the new tokens; k_nope, k_rope, value: the context
    tensors = (
        randn(61 + i, rows, h, w, dtype=kit.dtype_of(dt), device=device)
        for i, (rows, (h, w)) in enumerate(zip(tokens, _ring_widths(n)))
    )
    args = (*tensors, q_lens, kv_lens, (P + R) ** -0.5, False, prev_out, prev_lse)
    return KernelCall(args, {"mask": None})


def _ring_widths(n: int) -> tuple[tuple[int, int], ...]:
    """(heads, width) of ring MLA's q_nope, q_rope, k_nope, k_rope (one head, broadcast) and value."""
    return ((n, P), (n, R), (n, P), (1, R), (n, V))


def _cache_write(device: Any, *, bs: int, dt: str) -> KernelCall:
    seq_lens = [3, 140]
    table, nb = kit.block_table(66, seq_lens, bs, device)
    slots = kit.slots(table, kit.new_token_positions([3, 4], seq_lens), bs)
    slots = torch.cat((slots, torch.tensor([-1]))).to(device)  # one padding slot
    nope, rope = kit.latent_planes(67, nb, bs, kit.dtype_of(dt), device)
    t = slots.numel()
    kv_c, k_pe = (
        randn(68, t, L, dtype=kit.dtype_of(dt), device=device),
        randn(69, t, R, dtype=kit.dtype_of(dt), device=device),
    )
    return KernelCall((kv_c, k_pe, nope, rope, slots), {}, _planes_out(2, 3))


def _fused_write(device: Any, *, bs: int, dt: str) -> KernelCall:
    seq_lens = [3, 140]
    table, nb = kit.block_table(70, seq_lens, bs, device)
    slots = kit.slots(table, kit.new_token_positions([3, 4], seq_lens), bs).to(device)
    nope, rope = kit.latent_planes(71, nb, bs, kit.dtype_of(dt), device)
    t = slots.numel()
    cos, sin = _cos_sin(72, t, device, kit.dtype_of(dt))
    gamma = randn(73, L, dtype=kit.dtype_of(dt), device=device, scale=0.1) + 1
    kv = randn(74, t, L + R, dtype=kit.dtype_of(dt), device=device)
    return KernelCall((kv, gamma, cos, sin, slots, nope, rope, 1e-6), {}, _planes_out(5, 6))


def _load(device: Any, *, bs: int, dt: str) -> KernelCall:
    seq_lens = [300, 5, 129]
    table, nb = kit.block_table(75, seq_lens, bs, device)
    nope, rope = kit.latent_planes(76, nb, bs, kit.dtype_of(dt), device)
    lens = torch.tensor([128, 5, 1], dtype=torch.int32, device=device)
    starts = torch.tensor([128, 0, 128], dtype=torch.int32, device=device)
    return KernelCall((nope, rope, table, lens, starts), {"total": 134})  # host-known, as the backend passes


def _rope(device: Any, *, n: int, dt: str) -> KernelCall:
    t = 9
    cos, sin = _cos_sin(77, t, device, kit.dtype_of(dt))
    return KernelCall((randn(78, t, n, R, dtype=kit.dtype_of(dt), device=device), cos[:, None], sin[:, None]), {})


# The parameter tables: one row per shape (the builder's keywords), each crossed with HALVES.
_DECODE_SHAPES = ({"n": 32, "bs": 128}, {"n": 128, "bs": 16}, {"n": 64, "bs": 128})
_GRAPH_SHAPES = ((32, 128), (128, 16))  # (N, block size): compiled graph decode and latent write
_LATENT_SHAPES = ({"n": 32, "bs": 128}, {"n": 128, "bs": 16})  # (N, block size) of the spec decode
_DECODE = "ql_nope [3, {n}, {L}] q_pe [3, {n}, {R}], block {bs}, seqs [1, 150, 37]"


def _decode_cases() -> list[KernelCase]:
    """The absorbed decode (eager and graph-task forms), the compiled graph's pair and the spec-decode verification."""
    cases = [
        *grid(_DECODE_SHAPES, Spec(MLA_DECODE, _DECODE, partial(_decode, graph=False), "audit #9, #15")),
        *grid(
            [{"n": 32, "bs": 16}],
            Spec(
                MLA_DECODE,
                _DECODE + ", max workspace (graph task)",
                partial(_decode, graph=True),
                "audit #9, #15, graph-task form of the call",
            ),
        ),
    ]
    for n, bs in _GRAPH_SHAPES:
        for dt in HALVES:
            label = f"ql_nope [4, {n}, {L}] q_pe [4, {n}, {R}], block {bs}, lens [150, 37, 129, pad 2]"
            graph_decode = partial(_graph_decode, n=n, bs=bs, dt=dt)
            cases.append(KernelCase(MLA_GRAPH_DECODE, label, dt, graph_decode, note="torchair graph decode (MLA)"))
            label = f"kv_c [4, 1, {L}] k_pe [4, 1, {R}] -> latent planes, block {bs}, a padding slot 0"
            write = partial(_graph_write, bs=bs, dt=dt)
            cases.append(KernelCase(GRAPH_KV_WRITE, label, dt, write, note="torchair graph latent write"))
    spec = "ql_nope [10, {n}, {L}] q_pe [10, {n}, {R}], block {bs}, query lens [4, 1, 3, 2]"
    return cases + grid(_LATENT_SHAPES, Spec(MLA_SPEC_DECODE, spec, _spec_decode, "issue #15"))


def _prefill_cases() -> list[KernelCase]:
    """Ring MLA (the first causal ring, then a context ring merged by LSE) and the latent-cache kernels."""
    return [
        *grid(
            [{"n": 16}, {"n": 32}],
            Spec(RING_MLA, "first ring, causal, q=kv [5, 70, 1], heads {n}", _first_ring, "audit #10"),
            Spec(RING_MLA, "context ring + merge, q [5, 70, 1] kv [128, 300, 0], heads {n}", _context_ring),
        ),
        *grid(
            [{"bs": 128}, {"bs": 16}],
            Spec(MLA_CACHE_WRITE, "kv_c [8, {L}] k_pe [8, {R}] (1 pad) -> block {bs}", _cache_write, "audit #14, #15"),
            Spec(KV_RMSNORM_ROPE_CACHE, "kv [7, {L}+{R}] -> block {bs}", _fused_write, "audit #12"),
            Spec(PAGED_CACHE_LOAD, "block {bs}, chunks [128@128, 5@0, 1@128]", _load, "audit #11"),
        ),
    ]


def mla_cases() -> list[KernelCase]:
    return [
        *grid([{"n": 16}, {"n": 128}], Spec(WEIGHT_TO_ND, "kv_b_proj [{n}*({P}+{V}), {L}]", _to_nd, "audit #27")),
        *_decode_cases(),
        *_prefill_cases(),
        *grid([{"n": 16}, {"n": 128}], Spec(INTERLEAVE_ROPE, "q_pe [9, {n}, {R}]", _rope, "audit #13")),
    ]
