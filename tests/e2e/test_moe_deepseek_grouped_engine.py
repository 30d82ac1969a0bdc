# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device with a tiny DeepSeek-V3 whose router is the real V3 one, float32.

DeepSeek-V3 routing at small scale: 16 routed experts in 4 groups, keep the 2 best groups (group score = sum of
its top-2 biased sigmoid scores), top-4 experts, a non-zero ``e_score_correction_bias`` (written into the
checkpoint), normalised weights, ``routed_scaling_factor`` 2.5, plus a shared expert: vLLM's ``SharedFusedMoE``
becomes npu-ops' ``AscendSharedFusedMoE`` with the ``npu_moe_gating_top_k`` path (reference twin here). Attention
is MLA (npu-attention). Reference: HF transformers ``DeepseekV3ForCausalLM``, float32, greedy.
"""

from __future__ import annotations

import shutil

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

NUM_EXPERTS = 16


def tiny_deepseek_v3_grouped():
    # DeepSeek-V3's router: sigmoid scores, correction bias (noaux_tc), 4 groups keep 2, top-4, scaling 2.5.
    return tiny_config(
        "deepseek_v3",
        n_routed_experts=NUM_EXPERTS,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        routed_scaling_factor=2.5,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The testkit checkpoint with a random non-negative correction bias (HF saves it as zeros).

    Non-negative: HF masks the dropped groups with 0.0 where vLLM uses -inf, which agree when every biased sigmoid
    score is positive.
    """
    import torch
    from safetensors.torch import load_file, save_file

    base = build_tiny_model(tiny_deepseek_v3_grouped())
    out = tmp_path_factory.mktemp("deepseek_v3_grouped_ckpt")
    for f in base.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = load_file(base / "model.safetensors")
    biases = [k for k in tensors if k.endswith("gate.e_score_correction_bias")]
    assert biases, "the checkpoint has no e_score_correction_bias"
    gen = torch.Generator().manual_seed(5)
    for k in biases:
        tensors[k] = torch.rand(NUM_EXPERTS, generator=gen) * 0.3
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("deepseek_v3_grouped"))
    with engine(tiny_model, env, max_num_batched_tokens=64) as llm:
        yield llm


def _moe_layers(worker):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    model = worker.model_runner.get_model()
    return [
        (
            f"{type(m).__module__}.{type(m).__name__}",
            m.moe_plan.gate_path,
            m.use_grouped_topk,
            m.num_expert_group,
            m.topk_group,
            bool(m.e_score_correction_bias.abs().sum() > 0),
        )
        for m in model.modules()
        if isinstance(m, FusedMoE)
    ]


def test_shared_moe_class_and_v3_router_in_the_model(llm):
    (layers,) = llm.collective_rpc(_moe_layers)
    assert layers == [("vllm_npu.ops.moe.layer.AscendSharedFusedMoE", "grouped_topk", True, 4, 2, True)]


def test_batched_prompts_match_hf(llm, tiny_model):
    prompts = make_prompts([1, 7, 33, 120], seed=3)
    assert greedy(llm, prompts, 16) == hf_greedy(tiny_model, prompts, 16)
