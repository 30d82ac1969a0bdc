# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Block-id runs, the head mapping between TP sizes, cache descriptions, and the head scatter against its twin and
against a direct copy of the whole-model cache."""

from __future__ import annotations

import pytest
import torch
from vllm_npu.kv.layout import (
    HeadSlice,
    LayoutError,
    block_runs,
    describe_layer,
    head_sources,
    plane_view,
    scatter_heads,
    scatter_heads_reference,
)


def test_block_runs_merge_blocks_consecutive_on_both_sides() -> None:
    assert block_runs([5, 6, 7, 0, 11], [1, 2, 3, 9, 4]) == [(5, 1, 3), (0, 9, 1), (11, 4, 1)]
    assert block_runs([1, 2], [4, 6]) == [(1, 4, 1), (2, 6, 1)]
    assert block_runs([], []) == []
    with pytest.raises(LayoutError, match="2 local blocks for 1 remote"):
        block_runs([1, 2], [3])


def test_head_sources() -> None:
    # Equal TP: the same rank, all heads.
    assert head_sources(1, 2, 4, 2, 4) == [HeadSlice(1, 0, 0, 4)]
    # Prefill TP=2 (2 heads each) -> decode TP=1 (4 heads): both prefill ranks, each into its half.
    assert head_sources(0, 1, 4, 2, 2) == [HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 2)]
    # Prefill TP=1 (4 heads) -> decode TP=2 (2 heads each): rank 1 takes heads 2..3 of the single prefill rank.
    assert head_sources(1, 2, 2, 1, 4) == [HeadSlice(0, 2, 0, 2)]
    # Prefill TP=4 (1 head each) -> decode TP=2.
    assert head_sources(1, 2, 2, 4, 1) == [HeadSlice(2, 0, 0, 1), HeadSlice(3, 0, 1, 1)]
    with pytest.raises(LayoutError, match="replicated heads"):
        head_sources(0, 1, 1, 2, 1)  # 1 KV head replicated on 2 prefill ranks


def test_describe_gqa_mla_and_indexer_caches() -> None:
    gqa = describe_layer("a", torch.zeros(2, 10, 16, 2, 8, dtype=torch.bfloat16))
    block = 16 * 2 * 8 * 2
    assert not gqa.replicated and gqa.num_blocks == 10
    assert [(p.offset, p.block_bytes, p.heads, p.head_bytes) for p in gqa.planes] == [
        (0, block, 2, 16),
        (10 * block, block, 2, 16),
    ]
    mla = describe_layer("m", torch.zeros(10, 16, 40), kv_lora_rank=32)
    assert mla.replicated
    assert [(p.offset, p.block_bytes) for p in mla.planes] == [(0, 16 * 32 * 4), (10 * 16 * 32 * 4, 16 * 8 * 4)]
    idx = describe_layer("i", torch.zeros(10, 16, 12), kv_lora_rank=32)  # not wider than the latent: one plane
    assert [(p.offset, p.block_bytes) for p in idx.planes] == [(0, 16 * 12 * 4)]
    assert mla.nbytes == 10 * 16 * 40 * 4
    assert type(mla).from_json(mla.to_json()) == mla
    with pytest.raises(LayoutError, match="not contiguous"):
        describe_layer("t", torch.zeros(2, 10, 16, 2, 8).transpose(2, 3))
    with pytest.raises(LayoutError, match="has shape"):
        describe_layer("x", torch.zeros(10, 16))


@pytest.mark.parametrize("fn", [scatter_heads, scatter_heads_reference], ids=["scatter", "reference"])
def test_scatter_from_two_prefill_ranks_equals_the_direct_copy(fn) -> None:
    """Decode TP=1 assembling blocks from prefill TP=2 equals copying the whole-model cache's blocks."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 9, 16, 4, 8, generator=g)  # the prefill side's whole-model cache (4 heads)
    local_ids, remote_ids = [4, 0, 7], [2, 5, 1]
    direct = torch.zeros_like(full)
    direct[:, local_ids] = full[:, remote_ids]
    got = torch.zeros_like(full)
    layout = describe_layer("l", got)
    for rank, s in enumerate(head_sources(0, 1, 4, 2, 2)):
        shard = full[:, :, :, rank * 2 : rank * 2 + 2]  # what prefill rank `rank` holds
        for plane in range(2):
            staged = shard[plane, remote_ids].contiguous()  # what the Mooncake read puts in the staging buffer
            fn(staged, plane_view(got, layout, plane), local_ids, s.src_start, s.dst_start, s.count)
    torch.testing.assert_close(got, direct, rtol=0, atol=0)


def test_scatter_twins_agree_on_a_byte_view() -> None:
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 6, 16, 4, 8, generator=g, dtype=torch.float32)
    a, b = cache.clone(), cache.clone()
    staged = torch.randint(0, 255, (2, 16, 2, 32), generator=g, dtype=torch.uint8)
    for target, fn in ((a, scatter_heads), (b, scatter_heads_reference)):
        fn(staged, plane_view(target.view(torch.uint8), describe_layer("l", target), 1), [3, 1], 1, 2, 1)
    assert torch.equal(a, b) and not torch.equal(a, cache)
    with pytest.raises(LayoutError, match="2 staged blocks for 1 block ids"):
        scatter_heads(staged, plane_view(a, describe_layer("l", a), 0), [1], 0, 0, 1)
