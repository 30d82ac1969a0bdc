# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Kernel-level test harness: hand-built paged batches, vLLM's CommonAttentionMetadata, and a dense reference.

The dense reference is the obviously-correct form: for every request, the full key/value sequence is kept as a
plain tensor, and ``softmax(scale * Q K^T + explicit mask) V`` is computed in float64 head by head with the KV head
``h // (N // Nkv)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from vllm.v1.attention.backends.utils import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm_npu.attention.backends.gqa import AscendAttentionBackend, AscendAttentionImpl
from vllm_npu.attention.metadata import AscendAttentionMetadataBuilder


@dataclass
class Batch:
    q_lens: list[int]
    ctx_lens: list[int]
    query: torch.Tensor  # [T + pad, N, D]
    key: torch.Tensor  # [T + pad, Nkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, nb, bs, Nkv, D]
    full_k: list[torch.Tensor] = field(default_factory=list)  # per request [L, Nkv, D]
    full_v: list[torch.Tensor] = field(default_factory=list)
    common: CommonAttentionMetadata | None = None
    num_pad: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    num_pad: int = 0,
    causal: bool = True,
    seed: int = 0,
) -> Batch:
    """A batch whose request ``b`` has ``ctx_lens[b]`` cached tokens (already in the paged cache) and ``q_lens[b]``
    new tokens. Blocks are a random permutation of ids >= 1 (block 0 is vLLM's null block); unused cache memory holds
    random finite values; ``num_pad`` padding tokens with slot -1 follow the real tokens."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    blocks_per_req = [max(1, math.ceil(s / block_size)) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + 3
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    max_blocks = max(blocks_per_req) + 2
    block_table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=g).to(dtype)
    full_k, full_v = [], []
    new_k, new_v, slots = [], [], []
    cursor = 0
    for b, (_q, c, s) in enumerate(zip(q_lens, ctx_lens, seq_lens)):
        ids = perm[cursor : cursor + blocks_per_req[b]]
        cursor += blocks_per_req[b]
        block_table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(s, num_kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(s, num_kv_heads, head_size, generator=g).to(dtype)
        full_k.append(k)
        full_v.append(v)
        for pos in range(s):
            slot = ids[pos // block_size] * block_size + pos % block_size
            if pos < c:  # context: already cached
                kv_cache[0, slot // block_size, slot % block_size] = k[pos]
                kv_cache[1, slot // block_size, slot % block_size] = v[pos]
            else:
                new_k.append(k[pos])
                new_v.append(v[pos])
                slots.append(slot)
    t = len(slots)
    key = torch.cat([torch.stack(new_k), torch.randn(num_pad, num_kv_heads, head_size, generator=g).to(dtype)])
    value = torch.cat([torch.stack(new_v), torch.randn(num_pad, num_kv_heads, head_size, generator=g).to(dtype)])
    query = torch.randn(t + num_pad, num_heads, head_size, generator=g).to(dtype)
    slot_mapping = torch.tensor(slots + [-1] * num_pad, dtype=torch.int64)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl,
        seq_lens=seq_t.clone(),
        seq_lens_cpu=seq_t,
        num_computed_tokens_cpu=torch.tensor(ctx_lens, dtype=torch.int32),
        num_reqs=len(q_lens),
        num_actual_tokens=t,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
        causal=causal,
    )
    return Batch(list(q_lens), list(ctx_lens), query, key, value, kv_cache, full_k, full_v, common, num_pad)


def make_builder(
    block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, num_speculative_tokens: int = 0
) -> AscendAttentionMetadataBuilder:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    vllm_config = SimpleNamespace(
        speculative_config=(
            SimpleNamespace(num_speculative_tokens=num_speculative_tokens) if num_speculative_tokens else None
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )
    return AscendAttentionMetadataBuilder(spec, ["layer.0"], vllm_config, torch.device("cpu"))


def run_impl(
    batch: Batch,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    encoder_only: bool = False,
    num_speculative_tokens: int = 0,
    scale: float | None = None,
    block_size: int | None = None,
):
    """Build the metadata with the real builder and run the impl; returns (output, metadata). ``block_size``
    defaults to the ND cache's (``kv_cache.shape[2]``); an NZ (310P) cache must name it."""
    scale = head_size**-0.5 if scale is None else scale
    block_size = batch.kv_cache.shape[2] if block_size is None else block_size
    builder = make_builder(block_size, num_kv_heads, head_size, batch.query.dtype, num_speculative_tokens)
    md = builder.build(0, batch.common)
    impl = AscendAttentionImpl(
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        None,
        sliding_window,
        "auto",
        logits_soft_cap,
        "encoder_only" if encoder_only else "decoder",
    )
    output = torch.full_like(batch.query, 7.0)
    ret = impl.forward(None, batch.query, batch.key, batch.value, batch.kv_cache, md, output=output)
    assert ret is output
    return output, md


def dense_reference(
    batch: Batch,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """``[T, N, D]`` float64: plain softmax(QK^T)V per request and head with an explicit mask."""
    scale = head_size**-0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    outs = []
    start = 0
    for b, q_len in enumerate(batch.q_lens):
        q = batch.query[start : start + q_len].double()
        start += q_len
        k, v = batch.full_k[b].double(), batch.full_v[b].double()
        seq_len, ctx = k.shape[0], batch.ctx_lens[b]
        mask = torch.zeros(q_len, seq_len, dtype=torch.float64)
        for i in range(q_len):
            qp = ctx + i
            for j in range(seq_len):
                visible = j <= qp if causal else True
                if sliding_window is not None:
                    visible = visible and (qp - j < sliding_window if causal else abs(qp - j) < sliding_window)
                if not visible:
                    mask[i, j] = float("-inf")
        o = torch.empty(q_len, num_heads, head_size, dtype=torch.float64)
        for h in range(num_heads):
            s = q[:, h] @ k[:, h // group].T * scale
            if logits_soft_cap:
                s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
            p = torch.softmax(s + mask, dim=-1)
            o[:, h] = p @ v[:, h // group]
        outs.append(o)
    return torch.cat(outs)


TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}

__all__ = ["TOLERANCES", "AscendAttentionBackend", "Batch", "dense_reference", "make_batch", "make_builder", "run_impl"]
