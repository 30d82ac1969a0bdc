# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Pangu Pro MoE without an engine: MoGE routing against a brute force written from its definition, the balance it
exists for, its errors, and the registrations (the config with transformers' AutoConfig, the architecture with
vLLM's ModelRegistry). Greedy generation against a float64 reference is in tests/e2e/test_pangu_moe*_engine.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_npu.interface import ConfigError  # noqa: E402

# (num_experts, top_k, num_groups): the published 64/8/8, the tiny test model's 8/2/2, two experts per group, an
# odd group count.
SHAPES = [(64, 8, 8), (8, 2, 2), (16, 8, 4), (12, 6, 3)]


def _brute_force(logits: torch.Tensor, scale: torch.Tensor, top_k: int, groups: int) -> list[list[tuple[int, float]]]:
    """Per token, per group in order, its top_k/groups experts by descending softmax score: (id, score * scale)."""
    probs = torch.softmax(logits.double(), dim=-1)
    size, share = logits.shape[1] // groups, top_k // groups
    out = []
    for t in range(logits.shape[0]):
        row = []
        for g in range(groups):
            members = sorted(range(g * size, (g + 1) * size), key=lambda e: -float(probs[t, e]))
            row += [(e, float(probs[t, e] * scale[e])) for e in members[:share]]
        out.append(row)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_experts", "top_k", "groups"), SHAPES)
def test_moge_routing_matches_brute_force(num_experts, top_k, groups, dtype):
    from vllm_npu.models.pangu_moe import moge_select_experts

    gen = torch.Generator().manual_seed(num_experts * 100 + top_k)
    if dtype == torch.bfloat16:
        # Distinct values per row (steps of 0.05 are exact enough in bf16), so no tie makes the order ambiguous.
        logits = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(37)]).mul(0.05).to(dtype)
    else:
        logits = torch.randn(37, num_experts, generator=gen) * 2
    scale = torch.rand(1, num_experts, generator=gen) + 0.5
    weights, ids = moge_select_experts(logits, scale, top_k=top_k, num_groups=groups)
    assert (weights.dtype, ids.dtype, tuple(ids.shape)) == (torch.float32, torch.int32, (37, top_k))
    expected = _brute_force(logits.float(), scale.reshape(-1), top_k, groups)
    assert ids.tolist() == [[e for e, _ in row] for row in expected]
    # float32 scores against the float64 brute force
    want = torch.tensor([[w for _, w in row] for row in expected], dtype=torch.float64)
    torch.testing.assert_close(weights.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("num_experts", "top_k", "groups"), SHAPES)
def test_every_group_gets_the_same_share_of_every_token(num_experts, top_k, groups):
    """The point of MoGE: with group g on device g, each device receives exactly top_k/groups slots per token."""
    from vllm_npu.models.pangu_moe import moge_select_experts

    logits = torch.randn(200, num_experts, generator=torch.Generator().manual_seed(1))
    _, ids = moge_select_experts(logits, torch.ones(num_experts), top_k=top_k, num_groups=groups)
    per_group = torch.zeros(200, groups, dtype=torch.int64)
    per_group.scatter_add_(1, ids.long() // (num_experts // groups), torch.ones_like(ids, dtype=torch.int64))
    assert bool((per_group == top_k // groups).all())
    # Unlike plain top-k over the same scores, which piles slots onto whichever group happens to score high.
    plain = torch.softmax(logits, -1).topk(top_k, dim=-1).indices // (num_experts // groups)
    assert any(len(set(row.tolist())) < groups for row in plain)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "groups", "match"),
    [(10, 4, 4, "divisible"), (8, 3, 2, "divisible"), (8, 2, 0, "divisible")],
)
def test_bad_group_shapes_are_config_errors(num_experts, top_k, groups, match):
    from vllm_npu.models.pangu_moe import moge_select_experts

    with pytest.raises(ConfigError, match=match):
        moge_select_experts(torch.zeros(2, num_experts), torch.ones(num_experts), top_k=top_k, num_groups=groups)


def test_the_routing_function_reads_the_loaded_router_scale_and_refuses_renormalisation():
    from vllm_npu.models.pangu_moe import MoGERouting

    scale = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    route = MoGERouting(scale, num_groups=2)
    logits = torch.tensor([[4.0, 0.0, 0.0, 3.0]])
    weights, ids = route(hidden_states=torch.zeros(1, 8), gating_output=logits, topk=2, renormalize=False)
    assert ids.tolist() == [[0, 3]]
    scale.data.copy_(torch.tensor([2.0, 1.0, 1.0, 0.5]))  # what a weight loader does
    scaled, _ = route(hidden_states=torch.zeros(1, 8), gating_output=logits, topk=2, renormalize=False)
    torch.testing.assert_close(scaled, weights * torch.tensor([[2.0, 0.5]]))
    with pytest.raises(ValueError, match="renormalize=False"):
        route(hidden_states=torch.zeros(1, 8), gating_output=logits, topk=2, renormalize=True)


def test_a_config_with_dense_layers_is_refused():
    from types import SimpleNamespace

    from vllm_npu.models.pangu_moe import _check_config

    with pytest.raises(ConfigError, match="mlp_only_layers"):
        _check_config(SimpleNamespace(mlp_only_layers=[0], hidden_size=64, num_attention_heads=4))
    with pytest.raises(ConfigError, match="head dim"):
        _check_config(SimpleNamespace(hidden_size=66, num_attention_heads=4))


# --- registrations ---------------------------------------------------------------------------------------------


def test_a_local_checkpoint_config_loads_through_autoconfig(tmp_path):
    from npu_testkit.pangu import PANGU_TINY, build_tiny_pangu
    from transformers import AutoConfig
    from vllm_npu.models._hooks import register_configs
    from vllm_npu.models.pangu_config import PanguProMoEConfig

    register_configs()
    assert register_configs() == []  # idempotent: transformers' mapping already has it
    cfg = AutoConfig.from_pretrained(build_tiny_pangu(tmp_path / "ckpt"))
    assert type(cfg) is PanguProMoEConfig and cfg.architectures == ["PanguProMoEForCausalLM"]
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        assert getattr(cfg, key) == PANGU_TINY[key]


def test_config_defaults_are_the_published_model():
    from vllm_npu.models.pangu_config import PanguProMoEConfig

    cfg = PanguProMoEConfig()
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers, cfg.hidden_size) == (64, 8, 48, 5120)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (40, 8, 153376)


def test_the_architecture_is_registered_lazily():
    from vllm import ModelRegistry
    from vllm_npu.models._hooks import register_models

    register_models()
    entry = ModelRegistry.models["PanguProMoEForCausalLM"]
    assert (entry.module_name, entry.class_name) == ("vllm_npu.models.pangu_moe", "AscendPanguProMoEForCausalLM")


# --- weight loading helpers ------------------------------------------------------------------------------------


def test_router_scale_loads_from_either_checkpoint_shape_and_refuses_a_wrong_size():
    from vllm_npu.models.pangu_moe import _load_router_scale

    param = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    _load_router_scale(param, torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert param.tolist() == [1.0, 2.0, 3.0, 4.0]
    _load_router_scale(param, torch.tensor([4.0, 3.0, 2.0, 1.0]))
    assert param.tolist() == [4.0, 3.0, 2.0, 1.0]
    with pytest.raises(ValueError, match="does not fit 4 experts"):
        _load_router_scale(param, torch.ones(1, 8))


def test_a_checkpoint_tensor_without_a_parameter_is_an_error_naming_both():
    from vllm_npu.models.pangu_moe import _param

    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.extra'.*does not match"):
        _param({}, "model.layers.0.mlp.extra", "model.layers.0.mlp.extra")
