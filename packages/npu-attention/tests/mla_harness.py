# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""MLA / SFA test harness: a hand-built paged latent cache, the step inputs vLLM hands the impl, and a dense,
obviously correct reference.

The dense reference materialises every request's K and V from its latents with ``kv_b_proj``
(``k = [kv_c @ W_UK, k_pe]``, ``v = kv_c @ W_UV``) and runs plain softmax attention in float64. The backend
runs the real metadata builder and impl (reference kernels) on a paged cache whose blocks are scattered at random.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.v1.attention.backends.utils import CommonAttentionMetadata
from vllm_npu.attention.backends.mla import AscendMLAImpl, AscendMLAMetadataBuilder
from vllm_npu.attention.backends.sfa import AscendSFAImpl
from vllm_npu.attention.ops.mla_cache import latent_cache_planes, mla_cache_write_reference


class KvBProj(torch.nn.Module):
    """Stand-in for vLLM's ColumnParallelLinear ``kv_b_proj`` (unquantised, TP=1): returns ``(y, None)``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method = UnquantizedLinearMethod()
        self.input_size_per_partition = weight.shape[1]

    def forward(self, x: torch.Tensor):
        return x @ self.weight.T.to(x.dtype), None


@dataclass
class Dims:
    N: int = 4  # heads
    L: int = 32  # kv_lora_rank
    R: int = 16  # rope dim
    P: int = 24  # qk_nope_head_dim
    V: int = 20  # v_head_dim


@dataclass
class Scenario:
    dims: Dims
    block_size: int
    reqs: list[tuple[int, int]]  # (context_len, query_len) per request, decodes first
    kv_c: list[torch.Tensor]  # per request [total, L]
    k_pe: list[torch.Tensor]  # per request [total, R]
    q: list[torch.Tensor]  # per request [q_len, N, P + R]
    w_kv_b: torch.Tensor  # [N * (P + V), L]
    block_table: torch.Tensor
    slots: list[torch.Tensor]  # per request [total]
    kv_cache: torch.Tensor
    scale: float
    pad: int


def make_scenario(reqs, block_size, *, dims=None, seed=0, pad=0, dtype=torch.float32, spare_blocks=3) -> Scenario:
    d = dims or Dims()
    g = torch.Generator().manual_seed(seed)
    totals = [c + q for c, q in reqs]
    nblk = [math.ceil(t / block_size) for t in totals]
    num_blocks = 1 + sum(nblk) + spare_blocks  # block 0 is vLLM's null block
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    block_table = torch.zeros(len(reqs), max(nblk) + 2, dtype=torch.int32)
    slots = []
    for b, (t, nb) in enumerate(zip(totals, nblk, strict=True)):
        ids = [perm.pop() for _ in range(nb)]
        block_table[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(t)
        slots.append(block_table[b, pos // block_size].long() * block_size + pos % block_size)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    kv_c = [rnd(t, d.L) for t in totals]
    k_pe = [rnd(t, d.R) for t in totals]
    q = [rnd(ql, d.N, d.P + d.R) for _, ql in reqs]
    w = rnd(d.N * (d.P + d.V), d.L) / math.sqrt(d.L)
    kv_cache = torch.zeros(num_blocks, block_size, d.L + d.R, dtype=dtype)
    nope, rope = latent_cache_planes(kv_cache, d.L, d.R)
    for b, (c, _) in enumerate(reqs):  # prior steps already cached the context
        mla_cache_write_reference(kv_c[b][:c], k_pe[b][:c], nope, rope, slots[b][:c])
    scale = 1.0 / math.sqrt(d.P + d.R)
    return Scenario(d, block_size, list(reqs), kv_c, k_pe, q, w, block_table, slots, kv_cache, scale, pad)


def dense_reference(s: Scenario, selection: list[list[set[int]]] | None = None) -> torch.Tensor:
    """``[sum(q_len), N * V]``: per request, materialise K/V from the latents and run softmax attention in float64,
    causal, or (``selection[b][i]``: the positions new token ``i`` of request ``b`` may attend) over a selection."""
    d = s.dims
    outs = []
    for b, (c, ql) in enumerate(s.reqs):
        kv = (s.kv_c[b].double() @ s.w_kv_b.double().T).view(-1, d.N, d.P + d.V)
        k_nope, v = kv.split([d.P, d.V], dim=-1)
        k = torch.cat([k_nope, s.k_pe[b].double()[:, None, :].expand(-1, d.N, -1)], dim=-1)  # [S, N, P + R]
        score = torch.einsum("qnd,knd->nqk", s.q[b].double(), k) * s.scale
        if selection is None:
            qpos = torch.arange(c, c + ql)[:, None]
            kpos = torch.arange(c + ql)[None, :]
            masked = kpos > qpos
        else:
            allowed = torch.zeros(ql, c + ql, dtype=torch.bool)
            for i, chosen in enumerate(selection[b]):
                allowed[i, sorted(chosen)] = True
            masked = ~allowed
        score = score.masked_fill(masked, float("-inf"))
        outs.append(torch.einsum("nqk,knv->qnv", torch.softmax(score, -1), v).reshape(ql, d.N * d.V))
    return torch.cat(outs)


def make_impl(s: Scenario) -> AscendMLAImpl:
    d = s.dims
    impl = AscendMLAImpl(
        d.N, d.L + d.R, s.scale, 1, None, None, "auto", None, "decoder", None,
        q_lora_rank=None, kv_lora_rank=d.L, qk_nope_head_dim=d.P, qk_rope_head_dim=d.R,
        qk_head_dim=d.P + d.R, v_head_dim=d.V, kv_b_proj=KvBProj(s.w_kv_b),
    )  # fmt: skip
    impl.process_weights_after_loading(s.kv_cache.dtype)
    return impl


def make_sfa_impl(s: Scenario, topk_indices_buffer: torch.Tensor) -> AscendSFAImpl:
    """An SFA impl of the scenario's dims whose indexer hands it ``topk_indices_buffer`` (weights not yet split)."""
    d = s.dims
    return AscendSFAImpl(
        d.N, d.L + d.R, s.scale, 1, None, None, "auto", None, "decoder", None,
        q_lora_rank=None, kv_lora_rank=d.L, qk_nope_head_dim=d.P, qk_rope_head_dim=d.R,
        qk_head_dim=d.P + d.R, v_head_dim=d.V, kv_b_proj=KvBProj(s.w_kv_b),
        indexer=SimpleNamespace(topk_indices_buffer=topk_indices_buffer),
    )  # fmt: skip


def builder_config(s: Scenario, **extra: object) -> SimpleNamespace:
    """The parts of a VllmConfig the MLA builder reads (plus ``extra`` sections; no speculative decoding unless
    ``extra`` gives a ``speculative_config``: vLLM's reorder-threshold setup reads it)."""
    sections: dict[str, object] = {"speculative_config": None, **extra}
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        cache_config=SimpleNamespace(block_size=s.block_size),
        model_config=SimpleNamespace(max_model_len=4096),
        **sections,
    )


def make_builder(s: Scenario, chunk_tokens: int | None = None) -> AscendMLAMetadataBuilder:
    spec = SimpleNamespace(block_size=s.block_size)
    builder = AscendMLAMetadataBuilder(spec, ["layer"], builder_config(s), torch.device("cpu"))
    if chunk_tokens is not None:
        builder.context_chunk_tokens = chunk_tokens
    return builder


def step_inputs(s: Scenario):
    """The tensors vLLM hands the impl for this step: new tokens of every request, then ``pad`` padding tokens."""
    d = s.dims
    q = torch.cat(s.q + [torch.randn(s.pad, d.N, d.P + d.R).to(s.q[0].dtype)])
    kv_c = torch.cat([s.kv_c[b][c:] for b, (c, _) in enumerate(s.reqs)] + [torch.randn(s.pad, d.L).to(q.dtype)])
    k_pe = torch.cat([s.k_pe[b][c:] for b, (c, _) in enumerate(s.reqs)] + [torch.randn(s.pad, d.R).to(q.dtype)])
    slot_mapping = torch.cat(
        [s.slots[b][c:] for b, (c, _) in enumerate(s.reqs)] + [torch.full((s.pad,), -1, dtype=torch.long)]
    )
    q_lens = torch.tensor([ql for _, ql in s.reqs], dtype=torch.int32)
    seq_lens = torch.tensor([c + ql for c, ql in s.reqs], dtype=torch.int32)
    qsl = torch.zeros(len(s.reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    n = int(qsl[-1])
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        num_computed_tokens_cpu=seq_lens - q_lens,
        num_reqs=len(s.reqs),
        num_actual_tokens=n,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=s.block_table,
        slot_mapping=slot_mapping,
    )
    return q, kv_c, k_pe.unsqueeze(1), slot_mapping, common


def run_backend(s: Scenario, chunk_tokens: int | None = None, builder=None):
    d = s.dims
    q, kv_c, k_pe, _, common = step_inputs(s)
    builder = builder or make_builder(s, chunk_tokens)
    meta = builder.build(0, common)
    impl = make_impl(s)
    output = torch.full((q.shape[0], d.N * d.V), 7.0, dtype=q.dtype)
    impl.forward(None, q, kv_c, k_pe, s.kv_cache, meta, output=output)
    return output, meta


def assert_close(s: Scenario, got: torch.Tensor, want: torch.Tensor) -> None:
    tol = {torch.float32: 2e-4, torch.bfloat16: 4e-2, torch.float16: 5e-3}[got.dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
