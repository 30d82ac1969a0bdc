# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Speculative verification steps (``1 + k`` query tokens per request) in the torchair mode's compiled decode graph,
without an engine.

A verification step is laid out one row per token (``GraphDecodeInputs.per_token``): each token gets its request's
block table, its own KV slot and the causal length up to itself, so the single-token graph decode (the same kernels,
``graph_kv_write`` + ``graph_decode``) attends exactly as the eager multi-token decode does. Over steps whose request
counts, query lengths (1..k+1, mixed), sequence lengths, tables and slots change, the GQA impl compiled as the wrapper
compiles it must equal the eager impl on the same step (SpecDecoding state, reference kernels), write the same cache,
and compile once per graph size.
"""

from __future__ import annotations

import types

import pytest
import torch
from attn_harness import make_builder
from graph_harness import compiled_step
from vllm.v1.attention.backends.utils import CommonAttentionMetadata
from vllm_npu.attention.backends.gqa import AscendAttentionImpl
from vllm_npu.attention.metadata import GRAPH_PAD_SEQ_LEN, AscendAttentionState, AscendMetadata, GraphDecodeInputs
from vllm_npu.interface import configure_kernels, graph_inputs_of

NH, NKV, D, BS, NB, W = 4, 2, 16, 16, 40, 4  # heads, KV heads, head size, block size, blocks, table width
K = 2  # speculative tokens: up to 3 query tokens per request
B = 8  # the graph's rows (tokens)
LAYER = "model.layers.0.self_attn.attn"
STEP = types.SimpleNamespace(md=None)


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    configure_kernels("reference")


def _impl() -> AscendAttentionImpl:
    return AscendAttentionImpl(NH, D, D**-0.5, NKV, None, None, "auto", None, "decoder")


def _spec_step(requests: list[tuple[int, int]], g: torch.Generator, batch: int) -> CommonAttentionMetadata:
    """A verification step: request ``r`` = ``(seq_len, q)`` has ``q`` new tokens at positions ``seq_len - q ..
    seq_len - 1`` of its own random blocks (never the null block 0); slots padded with -1 to ``batch`` tokens."""
    n = len(requests)
    perm = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    table = torch.zeros(8, W, dtype=torch.int32)
    table[n:] = 5  # stale rows of the runner's persistent table
    slots: list[int] = []
    for r, (seq_len, q) in enumerate(requests):
        ids = perm[r * W : (r + 1) * W]
        table[r] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // BS] * BS + p % BS for p in range(seq_len - q, seq_len)]
    qlens = [q for _, q in requests]
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([s for s, _ in requests], dtype=torch.int32)
    t = sum(qlens)
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl,
        seq_lens=lens.clone(),
        seq_lens_cpu=lens,
        num_computed_tokens_cpu=lens - torch.tensor(qlens, dtype=torch.int32),
        num_reqs=n,
        num_actual_tokens=t,
        max_query_len=max(qlens),
        max_seq_len=int(lens.max()),
        block_table_tensor=table[:n],
        slot_mapping=torch.tensor(slots + [-1] * (batch - t), dtype=torch.int64),
        causal=True,
    )


def _build(
    requests: list[tuple[int, int]], seed: int
) -> tuple[AscendMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    md = make_builder(BS, NKV, D, torch.float32, num_speculative_tokens=K).build(0, _spec_step(requests, g, B))
    q = torch.randn(B, NH, D, generator=g)
    k = torch.randn(B, NKV, D, generator=g)
    v = torch.randn(B, NKV, D, generator=g)
    return md, q, k, v


def _call(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    return layer.impl.forward(layer, q, k, v, kv_cache, STEP.md, output=torch.empty_like(q))


def test_a_verification_step_is_laid_out_one_row_per_token():
    md, *_ = _build([(9, 3), (30, 1), (12, 2)], seed=1)
    assert md.attn_state is AscendAttentionState.SpecDecoding
    gi = graph_inputs_of(md, B)  # as the torchair wrapper calls it
    assert isinstance(gi, GraphDecodeInputs) and gi.block_table.shape == (B, W) and gi.slots.shape == (B,)
    # causal lengths: each token sees its request's cache up to and including itself; padding rows the null block
    assert gi.seq_lens_list == [7, 8, 9, 30, 11, 12] + [GRAPH_PAD_SEQ_LEN] * 2 == gi.seq_lens.tolist()
    rows = [0, 0, 0, 1, 2, 2]
    assert torch.equal(gi.block_table[:6], md.block_table[rows]) and bool((gi.block_table[6:] == 0).all())
    assert gi.slots[:6].tolist() == md.slot_mapping[:6].tolist() and gi.slots[6:].tolist() == [0, 0]
    with pytest.raises(ValueError, match="at most 4 tokens"):
        md.graph_inputs(4)  # 6 tokens do not fit a graph of 4 rows


def test_single_token_rows_per_token_equal_the_padded_layout():
    md, *_ = _build([(9, 1), (30, 1)], seed=2)
    one = GraphDecodeInputs.padded(md.block_table, md.seq_lens, md.seq_lens_list, md.slot_mapping, 2, B)
    per = GraphDecodeInputs.per_token(md.block_table, md.seq_lens_list, [1, 1], md.slot_mapping, B)
    for a, b in zip(vars(one).values(), vars(per).values(), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_a_step_with_a_row_of_length_one_is_declined_except_at_capture():
    # (3, 3): a 3-token prompt prefilled in a step vLLM counts as uniform decode (k = 2); its first token sees only
    # itself, which the graph's length floor would break: the wrapper runs the step eagerly.
    md, *_ = _build([(3, 3), (30, 3)], seed=3)
    assert md.attn_state is AscendAttentionState.SpecDecoding
    assert md.graph_inputs(B) is None and graph_inputs_of(md, B) is None
    md.capture = True  # vLLM's dummy capture batch has exactly these lengths: laid out, lengths floored
    gi = md.graph_inputs(B)
    assert gi is not None and gi.seq_lens_list[:6] == [GRAPH_PAD_SEQ_LEN, 2, 3, 28, 29, 30]


STEPS = [[(9, 3), (30, 3)], [(10, 2), (31, 1), (5, 3)], [(33, 3)], [(3, 2), (48, 3), (17, 3)], [(12, 1), (7, 2)]]


def test_compiled_verification_equals_the_eager_multi_token_decode_with_one_compile():
    impl = _impl()
    compiled, recorded = compiled_step(impl, LAYER, _call, dynamic=False)
    layer = types.SimpleNamespace(impl=impl, layer_name=LAYER)
    kv_cache = torch.randn(2, NB, BS, NKV, D)
    eager_cache = kv_cache.clone()
    for i, requests in enumerate(STEPS):
        md, q, k, v = _build(requests, seed=10 + i)
        assert md.attn_state is AscendAttentionState.SpecDecoding or max(ql for _, ql in requests) == 1
        t = md.num_actual_tokens
        STEP.md = md
        out = compiled({LAYER: md.graph_inputs(B)}, q, k, v, kv_cache)
        expected = impl.forward(layer, q, k, v, eager_cache, md, output=torch.empty_like(q))
        torch.testing.assert_close(out[:t], expected[:t], atol=2e-5, rtol=1e-5)
        assert bool(torch.isfinite(out).all())  # padding rows attend to the null block
        assert torch.equal(kv_cache[:, 1:], eager_cache[:, 1:]), f"step {i}"  # the same cache writes
    assert len(recorded.graphs) == 1, f"{len(recorded.graphs)} compiles for {len(STEPS)} steps"
    assert not any("unified_attention" in t for t in recorded.targets())
