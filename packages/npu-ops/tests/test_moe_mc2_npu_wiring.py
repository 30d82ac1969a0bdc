# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU side of MC2, run against a stand-in ``torch_npu`` on one rank.

The stand-in's ``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2`` sit behind torch_npu 2.8.0's
documented signatures (the meta registrations: ``npu_testkit.npu_binding_rules.documented``), check the argument
values the dispatcher relies on (group name, world, rank, expert count, capacity, counts mode, int32 ids, float32
expert scales, the A3-only TP arguments) and compute the documented exchange for one rank independently of our twin
(rows past the valid ones are NaN, so a caller that reads them fails; the assist info is the stand-in's own opaque
layout, so a caller that interprets it fails too). Then ``moe_forward`` through MC2 on the ``npu`` backend must equal
the ``reference`` backend's. What this cannot prove: the real kernels' numerics and the exchange across ranks.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from npu_testkit import npu_binding_rules as rules
from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward
from vllm_npu.ops.moe.gating import RoutingConfig
from vllm_npu.ops.moe.mc2 import MC2Comm, mc2_combine_npu, mc2_dispatch_npu

GROUP = "hccl_ep_group_0"


def _fake_torch_npu(calls: list[tuple[str, dict]], soc: str) -> types.ModuleType:
    m = types.ModuleType("torch_npu")
    stash: dict[str, torch.Tensor] = {}

    def npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, **kw):
        calls.append(("dispatch", kw))
        assert (group_ep, ep_world_size, ep_rank_id) == (GROUP, 1, 0)
        assert expert_ids.dtype == torch.int32 and kw["expert_token_nums_type"] == 1
        assert kw["expert_shard_type"] == 0 and kw["shared_expert_rank_num"] == 0
        assert ("tp_world_size" in kw) == (soc == "A3")
        bs, k = expert_ids.shape
        a = kw["global_bs"] * min(moe_expert_num, k)
        flat = expert_ids.reshape(-1).long()
        order = sorted(range(bs * k), key=lambda i: (int(flat[i]), i))
        quant = kw["quant_mode"] == 2
        expand_x = torch.full((a, x.shape[1]), float("nan"))
        scales = torch.full((a,), float("nan"))
        for row, slot in enumerate(order):
            v = x[slot // k].float()
            if quant:
                s = v.abs().max() / 127
                expand_x[row], scales[row] = torch.round(v / s), s
            else:
                expand_x[row] = v
        stash["order"] = torch.tensor(order)
        counts = torch.bincount(flat, minlength=moe_expert_num).to(torch.int64)
        assist = torch.randint(0, 1000, (max(bs * k, a * 128),), dtype=torch.int32)  # opaque to callers
        stash["assist"] = assist
        out_x = expand_x.to(torch.int8) if quant else expand_x.to(x.dtype)
        ep_recv = counts.cumsum(0).to(torch.int32)
        return out_x, scales, assist, counts, ep_recv, torch.zeros(1, dtype=torch.int32), torch.zeros(0)

    def npu_moe_distribute_combine_v2(
        expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep, ep_world_size,
        ep_rank_id, moe_expert_num, **kw,
    ):  # fmt: skip
        calls.append(("combine", kw))
        assert (group_ep, ep_world_size, ep_rank_id) == (GROUP, 1, 0)
        assert assist_info_for_combine is stash["assist"] and expert_scales.dtype == torch.float32
        assert ("tp_send_counts" in kw) == (soc == "A3")
        bs, k = expert_ids.shape
        out = torch.zeros(bs, expand_x.shape[1])
        for row, slot in enumerate(stash["order"].tolist()):
            out[slot // k] += expert_scales[slot // k, slot % k] * expand_x[row].float()
        return out.to(expand_x.dtype)

    for fn in (npu_moe_distribute_dispatch_v2, npu_moe_distribute_combine_v2):
        setattr(m, fn.__name__, rules.documented(fn))
    return m


class _Int8Rows:
    """Float experts that also take per-token int8 rows (dequantised first): MC2's dynamic-quant mode."""

    def __init__(self, float_experts):
        self.float_experts = float_experts

    def __call__(self, rows, counts):
        return self.float_experts(rows, counts)

    def run_int8(self, rows, scales, counts, out_dtype):
        return self.float_experts((rows.float() * scales.unsqueeze(1)).to(out_dtype), counts)


@pytest.mark.parametrize("soc", ["A2", "A3"])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("quant", [False, True])
def test_mc2_npu_calls_equal_the_reference(monkeypatch, soc, tokens, quant):
    calls: list[tuple[str, dict]] = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls, soc))
    gen = torch.Generator().manual_seed(5)
    e, h, i = 6, 16, 8
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen) / 4, torch.randn(e, h, i, generator=gen) / 3
    x, logits = torch.randn(tokens, h, generator=gen), torch.randn(tokens, e, generator=gen)
    ident = lambda t, out_splits, in_splits: t.clone()  # noqa: E731  the one-rank all-to-all of the twin
    outs = {}
    for backend in ("npu", "reference"):
        comm = MC2Comm(0, 1, ident, GROUP if backend == "npu" else "", soc)
        plan = build_moe_plan(
            RoutingConfig(top_k=2), e, act_dtype=torch.float32, mc2=comm, mc2_capacity=8, backend="reference"
        )
        mc2 = plan.mc2
        assert mc2 is not None
        if backend == "npu":  # the gate stays the reference one: this test is about the MC2 pair
            mc2.dispatch, mc2.combine = mc2_dispatch_npu, mc2_combine_npu
        experts = plan.unquantized_experts(w13, w2)
        outs[backend] = moe_forward(x, logits, plan=plan, experts=_Int8Rows(experts) if quant else experts)
    assert [c for c, _ in calls] == ["dispatch", "combine"]
    assert calls[0][1]["global_bs"] == 8 and calls[0][1]["quant_mode"] == (2 if quant else 0)
    torch.testing.assert_close(outs["npu"], outs["reference"], atol=1e-5, rtol=1e-5)


def test_mc2_kernel_choice_per_backend():
    from vllm_npu.ops.moe.mc2 import build_mc2, mc2_combine_reference, mc2_dispatch_reference
    from vllm_npu.ops.moe.placement import ExpertPlacement

    place = ExpertPlacement(4, [[0, 1], [2, 3]])
    npu = build_mc2(place, MC2Comm(0, 2), capacity=8, replicated_tokens=True, backend="npu")
    ref = build_mc2(place, MC2Comm(0, 2), capacity=8, replicated_tokens=False, backend="reference")
    assert (npu.dispatch, npu.combine) == (mc2_dispatch_npu, mc2_combine_npu)
    assert (ref.dispatch, ref.combine) == (mc2_dispatch_reference, mc2_combine_reference)
    # per-rank capacity: the step's share when the ranks hold the same tokens, the whole step otherwise
    assert (npu.max_tokens_per_rank, npu.global_bs, ref.max_tokens_per_rank, ref.global_bs) == (4, 8, 8, 16)
