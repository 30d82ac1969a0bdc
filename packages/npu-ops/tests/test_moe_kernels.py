# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Golden tests for the MoE reference kernels: gating, routing, grouped matmul, swiglu, unpermute, moe_forward.

References: plain math written out in the test, and vLLM 0.11's own torch implementations (``grouped_topk``,
``fused_topk_bias``, ``cpu_fused_moe.select_experts`` / ``CPUFusedMOE``, ``moe_torch_iterative.fused_moe``).
Tolerances: float32 results agree to 1e-5 (abs and rel) with vLLM; bfloat16 layer outputs agree with the float32
math to 3e-2 relative to the output scale (bf16 has an 8-bit mantissa; products of two bf16 matmuls).
"""

from __future__ import annotations

import types

import pytest
import torch
from vllm_npu.ops.moe import experts as ex
from vllm_npu.ops.moe import gating as g
from vllm_npu.ops.moe import routing as rt
from vllm_npu.ops.moe.forward import build_moe_plan, moe_forward

REF = "reference"


def _sorted_pairs(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order each row's (id, weight) pairs by id, so unsorted top-k results compare equal."""
    order = ids.long().argsort(dim=-1)
    return weights.float().gather(1, order), ids.long().gather(1, order)


def _vllm_grouped_topk():
    from vllm.model_executor.layers.fused_moe import fused_moe

    fn = fused_moe.grouped_topk
    # It is wrapped in torch.compile; the wrapped function is the plain torch reference.
    return getattr(fn, "_torchdynamo_orig_callable", fn)


# --- gating ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 1), (7, 12, 2), (33, 60, 4), (5, 3, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_softmax_matches_math_and_vllm(num_tokens, num_experts, top_k, renormalize, dtype):
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import select_experts

    torch.manual_seed(0)
    logits = torch.randn(num_tokens, num_experts, dtype=dtype)
    w, ids = g.topk_softmax_reference(logits, top_k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (num_tokens, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    # Plain math: the chosen experts are the k largest, the weights their probabilities (renormalised).
    kth = probs.sort(dim=-1, descending=True).values[:, top_k - 1 : top_k]
    assert bool((probs.gather(1, ids.long()) >= kth).all())
    expect = probs.gather(1, ids.long())
    if renormalize:
        expect = expect / expect.sum(-1, keepdim=True)
    torch.testing.assert_close(w, expect, atol=1e-6, rtol=1e-6)
    vw, vids = select_experts(
        hidden_states=torch.zeros(num_tokens, 4),
        router_logits=logits.float(),
        top_k=top_k,
        use_grouped_topk=False,
        renormalize=renormalize,
    )
    a, b = _sorted_pairs(w, ids), _sorted_pairs(vw, vids)
    torch.testing.assert_close(a[1], b[1])
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)


DS_CASES = [
    # (tokens, experts, groups, topk_group, top_k) — DeepSeek-V3 is (T, 256, 8, 4, 8)
    (1, 256, 8, 4, 8),
    (9, 16, 4, 2, 4),
    (4, 12, 3, 1, 1),  # 12 experts: not a power of two
    (6, 24, 4, 3, 6),
]


@pytest.mark.parametrize("num_tokens,num_experts,groups,topk_group,top_k", DS_CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_grouped_topk_reference_matches_vllm(num_tokens, num_experts, groups, topk_group, top_k, with_bias):
    torch.manual_seed(1)
    logits = torch.randn(num_tokens, num_experts)
    bias = torch.randn(num_experts) * 0.5 if with_bias else None
    rsf = 2.5
    w, ids = g.grouped_topk_reference(
        logits,
        bias,
        top_k=top_k,
        num_expert_group=groups,
        topk_group=topk_group,
        scoring_func="sigmoid",
        routed_scaling_factor=rsf,
    )
    vw, vids = _vllm_grouped_topk()(
        hidden_states=torch.zeros(num_tokens, 4),
        gating_output=logits,
        topk=top_k,
        renormalize=True,
        num_expert_group=groups,
        topk_group=topk_group,
        scoring_func="sigmoid",
        routed_scaling_factor=rsf,
        e_score_correction_bias=bias,
    )
    a, b = _sorted_pairs(w, ids), _sorted_pairs(vw, vids)
    torch.testing.assert_close(a[1], b[1])
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    # Plain math on top: every chosen expert lies in one of the kept groups, and weights sum to rsf.
    torch.testing.assert_close(w.sum(-1), torch.full((num_tokens,), rsf), atol=1e-5, rtol=1e-5)
    group_of = ids.long() // (num_experts // groups)
    assert all(row.unique().numel() <= topk_group for row in group_of)


def test_grouped_topk_softmax_without_renormalize_matches_vllm():
    torch.manual_seed(2)
    logits = torch.randn(5, 32)
    cfg = g.RoutingConfig(top_k=3, renormalize=False, use_grouped_topk=True, num_expert_group=4, topk_group=2)
    assert g.gate_path(cfg, 32) == "native"  # softmax grouped: the fused op's softmax renorm is undocumented
    w, ids = g.build_gate(cfg, 32, REF)(torch.zeros(5, 4), logits, None)
    tw, tids = g.grouped_topk_reference(
        logits, None, top_k=3, num_expert_group=4, topk_group=2, scoring_func="softmax", routed_scaling_factor=1.0
    )
    torch.testing.assert_close(_sorted_pairs(tw, tids)[0], _sorted_pairs(w, ids)[0])
    vw, vids = _vllm_grouped_topk()(
        hidden_states=torch.zeros(5, 4),
        gating_output=logits,
        topk=3,
        renormalize=False,
        num_expert_group=4,
        topk_group=2,
        scoring_func="softmax",
    )
    a, b = _sorted_pairs(w, ids), _sorted_pairs(vw, vids)
    torch.testing.assert_close(a[1], b[1])
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "cfg,path",
    [
        (g.RoutingConfig(top_k=2), "topk_softmax"),
        (g.RoutingConfig(top_k=2, has_correction_bias=True, routed_scaling_factor=1.5), "native"),
        (
            g.RoutingConfig(
                top_k=2,
                use_grouped_topk=True,
                num_expert_group=4,
                topk_group=2,
                scoring_func="sigmoid",
                has_correction_bias=True,
            ),
            "grouped_topk",
        ),
        (
            g.RoutingConfig(
                top_k=2,
                renormalize=False,
                use_grouped_topk=True,
                num_expert_group=4,
                topk_group=2,
                scoring_func="sigmoid",
                has_correction_bias=True,
            ),
            "native",
        ),
        (
            g.RoutingConfig(top_k=2, use_grouped_topk=True, num_expert_group=8, topk_group=2, scoring_func="softmax"),
            "native",
        ),  # 2 experts per group: below the fused op's minimum
    ],
)
def test_gate_paths_match_vllm_select_experts(cfg, path):
    from vllm.model_executor.layers.fused_moe import fused_moe

    num_experts = 16
    assert g.gate_path(cfg, num_experts) == path
    torch.manual_seed(3)
    logits = torch.randn(11, num_experts)
    bias = torch.randn(num_experts) if cfg.has_correction_bias else None
    w, ids = g.build_gate(cfg, num_experts, REF)(torch.zeros(11, 4), logits, bias)
    if cfg.use_grouped_topk:
        vw, vids = _vllm_grouped_topk()(
            hidden_states=torch.zeros(11, 4),
            gating_output=logits,
            topk=cfg.top_k,
            renormalize=cfg.renormalize,
            num_expert_group=cfg.num_expert_group,
            topk_group=cfg.topk_group,
            scoring_func=cfg.scoring_func,
            routed_scaling_factor=cfg.routed_scaling_factor,
            e_score_correction_bias=bias,
        )
    elif bias is not None:
        vw, vids = fused_moe.fused_topk_bias(torch.zeros(11, 4), logits, bias, cfg.top_k, cfg.renormalize)
        vw = vw * cfg.routed_scaling_factor
    else:
        probs = torch.softmax(logits, -1)
        vw, vids = probs.topk(cfg.top_k, -1)
        vw = vw / vw.sum(-1, keepdim=True)
    a, b = _sorted_pairs(w, ids), _sorted_pairs(vw, vids)
    torch.testing.assert_close(a[1], b[1])
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)


def test_custom_routing_function_is_called_with_vllm_keywords():
    seen = {}

    def custom(hidden_states, gating_output, topk, renormalize):
        seen.update(topk=topk, renormalize=renormalize)
        vals, idx = gating_output.topk(topk, dim=-1)
        return torch.sigmoid(vals), idx

    cfg = g.RoutingConfig(top_k=1, renormalize=False, custom_routing_function=custom)
    logits = torch.randn(4, 6)
    w, ids = g.build_gate(cfg, 6, REF)(torch.zeros(4, 2), logits, None)
    assert seen == {"topk": 1, "renormalize": False}
    torch.testing.assert_close(w, torch.sigmoid(logits.max(-1, keepdim=True).values))
    assert ids.dtype == torch.int32


def test_bad_routing_config_is_a_clear_error():
    from vllm_npu.interface import ConfigError

    with pytest.raises(ConfigError, match="not divisible"):
        g.build_gate(g.RoutingConfig(top_k=2, use_grouped_topk=True, num_expert_group=3, topk_group=1), 16, REF)
    with pytest.raises(ConfigError, match="top_k"):
        g.build_gate(g.RoutingConfig(top_k=9), 8, REF)


# --- routing ---------------------------------------------------------------------------------------------------


def _random_ids(num_tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices.to(torch.int32)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 1), (10, 7, 2), (64, 60, 4), (3, 3, 3)])
@pytest.mark.parametrize("expert_range", ["all", "part"])
def test_init_routing_reference_contract(num_tokens, num_experts, top_k, expert_range):
    hidden = torch.randn(num_tokens, 5)
    ids = _random_ids(num_tokens, num_experts, top_k, seed=num_tokens)
    start, end = (0, num_experts) if expert_range == "all" else (1, max(2, num_experts - 1))
    x, row_idx, counts = rt.init_routing_reference(hidden, ids, num_experts, (start, end))
    flat = ids.reshape(-1).long()
    in_range = (flat >= start) & (flat < end)
    n = int(in_range.sum())
    assert x.shape == (num_tokens * top_k, 5) and row_idx.dtype == torch.int32 and counts.dtype == torch.int64
    # counts per local expert
    expect_counts = torch.stack([(flat == e).sum() for e in range(start, end)])
    torch.testing.assert_close(counts, expect_counts)
    # the first n rows are the in-range slots, sorted stably by expert; the rest are -1 / zero
    valid_idx = row_idx[:n].long()
    assert bool((row_idx[n:] == -1).all()) and bool((x[n:] == 0).all())
    assert sorted(valid_idx.tolist()) == torch.nonzero(in_range).flatten().tolist()
    experts_of_rows = flat[valid_idx]
    assert bool((experts_of_rows[1:] >= experts_of_rows[:-1]).all())
    same = experts_of_rows[1:] == experts_of_rows[:-1]
    assert bool((valid_idx[1:][same] > valid_idx[:-1][same]).all())  # stable: slot order within an expert
    torch.testing.assert_close(x[:n], hidden[valid_idx // top_k])


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (6, 2), (17, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpermute_reference_and_combine_masked_match_math(num_tokens, top_k, dtype):
    torch.manual_seed(4)
    hidden = 9
    permuted = torch.randn(num_tokens * top_k, hidden).to(dtype)
    sorted_indices = torch.randperm(num_tokens * top_k).to(torch.int32)
    probs = torch.rand(num_tokens, top_k)
    out = rt.unpermute_reference(permuted, sorted_indices, probs)
    expect = torch.zeros(num_tokens, hidden)
    for i, flat in enumerate(sorted_indices.tolist()):  # plain math, one row at a time
        expect[flat // top_k] += probs[flat // top_k, flat % top_k] * permuted[i].float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expect, atol=tol, rtol=tol)
    torch.testing.assert_close(rt.combine_masked(permuted, sorted_indices, probs), out, atol=tol, rtol=tol)
    # combine_masked ignores rows marked -1, even if they hold NaN
    garbage = torch.cat([permuted, torch.full((3, hidden), float("nan"), dtype=dtype)])
    idx = torch.cat([sorted_indices, torch.full((3,), -1, dtype=torch.int32)])
    torch.testing.assert_close(rt.combine_masked(garbage, idx, probs), out, atol=tol, rtol=tol)


def test_unpermute_inverts_init_routing():
    """init_routing followed by unpermute with weights 1/k gives back the input (a round trip)."""
    hidden = torch.randn(13, 6)
    ids = _random_ids(13, 5, 2, seed=7)
    x, row_idx, _ = rt.init_routing_reference(hidden, ids, 5, (0, 5))
    out = rt.unpermute_reference(x, row_idx, torch.full((13, 2), 0.5))
    torch.testing.assert_close(out, hidden)


# --- grouped matmul and swiglu ---------------------------------------------------------------------------------


@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 1], [4], [1, 1, 1, 1, 1, 1, 1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_reference_matches_per_row_matmul(counts, dtype):
    torch.manual_seed(5)
    n, k, m = sum(counts), 8, 6
    x = torch.randn(n, k).to(dtype)
    w_vllm = torch.randn(len(counts), m, k).to(dtype)  # vLLM layout [E, N, K]; the kernel takes [E, K, N] views
    out = ex.grouped_matmul_reference(x, w_vllm.transpose(1, 2), torch.tensor(counts))
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    expect = torch.einsum("nk,nmk->nm", x.float(), w_vllm.float()[expert_of_row])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expect, atol=tol * 4, rtol=tol)
    with pytest.raises(ValueError, match="sum to"):
        ex.grouped_matmul_reference(x, w_vllm.transpose(1, 2), torch.tensor(counts) + 1)


def test_swiglu_reference_is_vllm_silu_and_mul():
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import silu_and_mul

    x = torch.randn(7, 10)
    torch.testing.assert_close(ex.swiglu_reference(x), silu_and_mul(x))


# --- whole layer math ------------------------------------------------------------------------------------------


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return w13, w2


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (40, 6, 1), (19, 10, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_forward_matches_vllm_torch_iterative(num_tokens, num_experts, top_k, renormalize):
    from vllm.model_executor.layers.fused_moe.moe_torch_iterative import fused_moe

    torch.manual_seed(6)
    hidden, inter = 16, 12
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32)
    x = torch.randn(num_tokens, hidden)
    logits = torch.randn(num_tokens, num_experts)
    plan = build_moe_plan(
        g.RoutingConfig(top_k=top_k, renormalize=renormalize), num_experts, act_dtype=torch.float32, backend=REF
    )
    assert plan.gate_path == "topk_softmax"
    out = moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13, w2))
    expect = fused_moe(x, w13, w2, logits, top_k, num_experts, renormalize=renormalize)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_forward_deepseek_router_matches_vllm_cpu_moe(with_bias, dtype):
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE

    torch.manual_seed(7)
    num_tokens, num_experts, hidden, inter = 21, 16, 24, 8
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32)
    x = torch.randn(num_tokens, hidden)
    logits = torch.randn(num_tokens, num_experts)
    bias = torch.randn(num_experts) * 0.3 if with_bias else None
    cfg = g.RoutingConfig(
        top_k=4,
        renormalize=True,
        use_grouped_topk=True,
        num_expert_group=4,
        topk_group=2,
        scoring_func="sigmoid",
        routed_scaling_factor=2.0,
        has_correction_bias=with_bias,
    )
    plan = build_moe_plan(cfg, num_experts, act_dtype=dtype, backend=REF)
    assert plan.gate_path == "grouped_topk"
    out = moe_forward(
        x.to(dtype),
        logits.to(dtype),
        plan=plan,
        experts=plan.unquantized_experts(w13.to(dtype), w2.to(dtype)),
        e_score_correction_bias=bias,
    )
    layer = types.SimpleNamespace(w13_weight=w13, w2_weight=w2)
    expect = CPUFusedMOE(layer)(
        layer,
        x,
        True,
        4,
        logits,
        True,
        topk_group=2,
        num_expert_group=4,
        global_num_experts=num_experts,
        scoring_func="sigmoid",
        routed_scaling_factor=2.0,
        e_score_correction_bias=bias,
    )
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    else:
        scale = expect.abs().max()
        assert float((out.float() - expect).abs().max() / scale) < 3e-2


def test_moe_forward_expert_parallel_partials_sum_to_the_whole():
    """Replicated tokens, experts split over 3 'ranks' (linear and round-robin): the partial outputs add up."""
    from vllm.model_executor.layers.fused_moe.layer import determine_expert_map

    torch.manual_seed(8)
    num_experts, hidden, inter, top_k = 10, 12, 6, 3
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32)
    x, logits = torch.randn(15, hidden), torch.randn(15, num_experts)
    cfg = g.RoutingConfig(top_k=top_k)
    full = build_moe_plan(cfg, num_experts, act_dtype=torch.float32, backend=REF)
    whole = moe_forward(x, logits, plan=full, experts=full.unquantized_experts(w13, w2))
    for strategy in ("linear", "round_robin"):
        total = torch.zeros_like(whole)
        for rank in range(3):
            _, emap = determine_expert_map(3, rank, num_experts, strategy)
            plan = build_moe_plan(cfg, num_experts, act_dtype=torch.float32, expert_map=emap, backend=REF)
            local = (emap >= 0).nonzero().flatten()[emap[emap >= 0].argsort()]  # local id -> global id
            total += moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13[local], w2[local]))
        torch.testing.assert_close(total, whole, atol=1e-5, rtol=1e-5)


def test_moe_forward_zero_tokens_and_router_weight_on_input():
    num_experts, hidden, inter = 4, 8, 4
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32)
    plan = build_moe_plan(
        g.RoutingConfig(top_k=1, renormalize=False),
        num_experts,
        act_dtype=torch.float32,
        apply_router_weight_on_input=True,
        backend=REF,
    )
    empty = moe_forward(
        torch.zeros(0, hidden), torch.zeros(0, num_experts), plan=plan, experts=plan.unquantized_experts(w13, w2)
    )
    assert empty.shape == (0, hidden)
    x, logits = torch.randn(5, hidden), torch.randn(5, num_experts)
    out = moe_forward(x, logits, plan=plan, experts=plan.unquantized_experts(w13, w2))
    probs = torch.softmax(logits, -1)
    w, e = probs.max(-1)
    expect = torch.stack([ex.swiglu_reference((w[t] * x[t]) @ w13[e[t]].T) @ w2[e[t]].T for t in range(5)])
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_package_door_is_import_light():
    from npu_testkit.import_light import assert_import_light

    assert_import_light(
        "import vllm_npu.ops.moe as m",
        "assert {'moe_forward', 'build_moe_plan', 'AscendFusedMoE', 'build_layer_plan'} <= set(m.__all__)",
        forbid=("torch", "vllm"),
    )
