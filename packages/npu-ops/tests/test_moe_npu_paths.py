# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU code paths of the MoE, run on the CPU against a stand-in ``torch_npu``.

There is no NPU here. The stand-in implements each op the way torch_npu 2.8.0's docs describe it (written
independently of our reference twins, one slot at a time where that is clearer) and checks the documented argument
constraints we rely on: the ``group_list_type=1`` counts sum to the rows given, unpermute gets bf16 and int64
indices, init_routing is called in count mode with ``active_num = T*k``, the rows past the in-range ones are
*undefined* (filled with NaN here, so a caller that reads them fails). Then ``moe_forward`` with the ``npu``
backend must equal the ``reference`` backend. What this cannot prove: the real kernels' numerics.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from npu_testkit import npu_binding_rules as rules
from vllm_npu.ops.moe import experts as ex
from vllm_npu.ops.moe import routing as rt
from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
from vllm_npu.ops.moe.gating import RoutingConfig


def _fake_torch_npu(calls: list[str]) -> types.ModuleType:
    m = types.ModuleType("torch_npu")

    def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
        calls.append("gating_top_k_softmax")
        assert finished is None and x.dtype == torch.float32
        y, idx = torch.softmax(x, -1).topk(k, -1)
        rows = torch.arange(x.shape[0]).unsqueeze(1) + x.shape[0] * torch.arange(k)
        return y, idx.int(), rows.int()

    def npu_moe_gating_top_k(
        x,
        k,
        bias=None,
        k_group=1,
        group_count=1,
        group_select_mode=0,
        renorm=0,
        norm_type=0,
        out_flag=False,
        routed_scaling_factor=1.0,
        eps=1e-20,
    ):
        calls.append("gating_top_k")
        assert renorm == 0 and x.shape[-1] % group_count == 0 and x.shape[-1] // group_count > 2
        assert bias is None or bias.dtype == x.dtype
        norm = x.sigmoid() if norm_type == 1 else x.softmax(-1)
        ys, idxs = [], []
        for row in range(x.shape[0]):  # one token at a time, as the docs describe it
            s = norm[row] + (0 if bias is None else bias)
            groups = s.view(group_count, -1)
            score = groups.topk(2).values.sum(-1) if group_select_mode == 1 else groups.max(-1).values
            keep = score.topk(k_group).indices
            cand = torch.full_like(s, float("-inf"))
            for gi in keep.tolist():
                width = groups.shape[1]
                cand[gi * width : (gi + 1) * width] = s[gi * width : (gi + 1) * width]
            idx = cand.topk(k).indices
            y = norm[row][idx]
            if norm_type == 1:
                y = y / (y.sum() + eps)
            ys.append(y * routed_scaling_factor)
            idxs.append(idx)
        return torch.stack(ys), torch.stack(idxs).int(), norm

    def npu_moe_init_routing_v2(
        x,
        expert_idx,
        *,
        scale=None,
        offset=None,
        active_num=-1,
        expert_capacity=-1,
        expert_num=-1,
        drop_pad_mode=0,
        expert_tokens_num_type=0,
        expert_tokens_num_flag=False,
        quant_mode=0,
        active_expert_range=(),
        row_idx_type=0,
    ):
        calls.append("init_routing_v2")
        t, k = expert_idx.shape
        assert expert_idx.dtype == torch.int32 and active_num == t * k and drop_pad_mode == 0
        assert expert_tokens_num_type == 1 and expert_tokens_num_flag and quant_mode == -1 and row_idx_type == 0
        lo, hi = active_expert_range
        slots = sorted(
            (e, flat) for flat, e in enumerate(expert_idx.reshape(-1).tolist()) if lo <= e < hi
        )  # (expert, slot) order = stable sort by expert
        out = torch.full((t * k, x.shape[1]), float("nan"), dtype=x.dtype)  # undefined past the valid rows
        row_idx = torch.full((t * k,), -1, dtype=torch.int32)
        for i, (_, flat) in enumerate(slots):
            out[i] = x[flat // k]
            row_idx[i] = flat
        counts = torch.tensor([sum(1 for e, _ in slots if e == j) for j in range(lo, hi)], dtype=torch.int64)
        return out, row_idx, counts, torch.empty(t * k)

    def npu_grouped_matmul(x, weight, *, group_list=None, split_item=0, group_type=None, group_list_type=0, **kw):
        calls.append("grouped_matmul")
        assert len(x) == 1 and len(weight) == 1 and split_item == 2 and group_type == 0 and group_list_type == 1
        assert not any(v is not None for v in kw.values())
        (xx,), (w,) = x, weight
        assert group_list.dtype == torch.int64 and int(group_list.sum()) == xx.shape[0], "counts must cover x"
        assert xx.shape[0] > 0, "empty grouped matmul (we never call it with no rows)"
        outs, start = [], 0
        for g, n in enumerate(group_list.tolist()):
            outs.append(xx[start : start + n] @ w[g])
            start += n
        return [torch.cat(outs)]

    def npu_swiglu(x, dim=-1):
        calls.append("swiglu")
        a, b = x.chunk(2, dim=dim)
        return a * torch.sigmoid(a) * b

    def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
        calls.append("token_unpermute")
        assert permuted_tokens.dtype == torch.bfloat16 and probs.dtype == torch.bfloat16
        assert sorted_indices.dtype == torch.int64 and not padded_mode
        t, k = probs.shape
        out = torch.zeros(t, permuted_tokens.shape[1])
        for i, flat in enumerate(sorted_indices.tolist()):
            out[flat // k] += probs[flat // k, flat % k].float() * permuted_tokens[i].float()
        return out.to(torch.bfloat16)

    for fn in (
        npu_moe_gating_top_k_softmax,
        npu_moe_gating_top_k,
        npu_moe_init_routing_v2,
        npu_grouped_matmul,
        npu_swiglu,
        npu_moe_token_unpermute,
    ):
        setattr(m, fn.__name__, rules.documented(fn))  # behind the documented 2.8.0 signature
    return m


@pytest.fixture
def npu_calls(monkeypatch):
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    return calls


def _weights(e, h, i, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype),
        (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype),
    )


CONFIGS = {
    "softmax": (RoutingConfig(top_k=2), 6, None),
    "deepseek": (
        RoutingConfig(
            top_k=3,
            use_grouped_topk=True,
            num_expert_group=4,
            topk_group=2,
            scoring_func="sigmoid",
            routed_scaling_factor=2.0,
            has_correction_bias=True,
        ),
        12,
        0.3,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ep", [False, True])
def test_npu_backend_equals_reference_backend(npu_calls, name, dtype, ep):
    cfg, num_experts, bias_scale = CONFIGS[name]
    torch.manual_seed(0)
    w13, w2 = _weights(num_experts, 16, 8, dtype)
    x = torch.randn(9, 16).to(dtype)
    logits = torch.randn(9, num_experts)
    bias = torch.rand(num_experts) * bias_scale if bias_scale else None
    expert_map, local = None, torch.arange(num_experts)
    if ep:  # this rank owns experts 1, 3, 4 (an arbitrary placement): a partial output
        local = torch.tensor([1, 3, 4])
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(3, dtype=torch.int32)
    outs = {}
    for backend in ("reference", "npu"):
        plan = build_moe_plan(cfg, num_experts, act_dtype=dtype, expert_map=expert_map, backend=backend)
        outs[backend] = moe_forward(
            x, logits, plan=plan, experts=plan.unquantized_experts(w13[local], w2[local]), e_score_correction_bias=bias
        )
    assert not torch.isnan(outs["npu"]).any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["npu"].float(), outs["reference"].float(), atol=tol, rtol=tol)
    gate_op = "gating_top_k_softmax" if name == "softmax" else "gating_top_k"
    expected = {gate_op, "init_routing_v2", "grouped_matmul", "swiglu"}
    if dtype == torch.bfloat16 and not ep:
        expected.add("token_unpermute")  # the NPU op is documented for bf16 only; other dtypes use combine_masked
    assert set(npu_calls) == expected


def test_kernel_choice_per_backend():
    npu = build_moe_plan(RoutingConfig(top_k=2), 6, act_dtype=torch.bfloat16, backend="npu")
    ref = build_moe_plan(RoutingConfig(top_k=2), 6, act_dtype=torch.bfloat16, backend="reference")
    assert npu.grouped_matmul is ex.grouped_matmul_npu and ref.grouped_matmul is ex.grouped_matmul_reference
    assert npu.activation is ex.swiglu_npu and ref.activation is ex.swiglu_reference
    assert npu.dispatcher.init_routing is rt.init_routing_npu and npu.dispatcher.unpermute is rt.unpermute_npu
    fp32 = build_moe_plan(RoutingConfig(top_k=2), 6, act_dtype=torch.float32, backend="npu")
    assert fp32.dispatcher.unpermute is rt.combine_masked  # not the bf16-only NPU op


def test_rank_without_routed_rows_skips_the_experts(npu_calls):
    """EP over replicated tokens where no token picks this rank's only expert: output zeros, no grouped matmul."""
    w13, w2 = _weights(4, 16, 8, torch.float32)
    x = torch.randn(5, 16)
    logits = torch.tensor([[5.0, 4.0, 0.0, -9.0]]).repeat(5, 1)  # expert 3 is never in the top-2
    expert_map = torch.tensor([-1, -1, -1, 0], dtype=torch.int32)
    plan = build_moe_plan(RoutingConfig(top_k=2), 4, act_dtype=torch.float32, expert_map=expert_map, backend="npu")
    out = moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13[3:], w2[3:]))
    assert torch.equal(out, torch.zeros_like(x))
    assert "grouped_matmul" not in npu_calls and "init_routing_v2" in npu_calls
