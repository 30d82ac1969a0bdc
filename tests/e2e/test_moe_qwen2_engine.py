# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device with a tiny Qwen2-MoE model, float32: top-4 of 10 experts *without*
renormalisation (``norm_topk_prob=False``), plus Qwen2-MoE's sigmoid-gated shared expert (vLLM's own MLP around our
AscendFusedMoE). Reference: HF transformers ``Qwen2MoeForCausalLM``, greedy.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine


def tiny_qwen2_moe():
    import transformers

    return transformers.Qwen2MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=10,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_qwen2_moe())


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("qwen2_moe"))
    with engine(tiny_model, env, max_num_batched_tokens=64) as llm:
        yield llm


def _moe_layers(worker):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    model = worker.model_runner.get_model()
    return [
        (type(m).__name__, m.renormalize, m.top_k, m.moe_plan.gate_path)
        for m in model.modules()
        if isinstance(m, FusedMoE)
    ]


def test_our_moe_class_is_in_the_model(llm):
    (layers,) = llm.collective_rpc(_moe_layers)
    assert layers == [("AscendFusedMoE", False, 4, "topk_softmax")] * 2


def test_batched_prompts_match_hf(llm, tiny_model):
    prompts = make_prompts([1, 6, 30, 120], seed=4)
    assert greedy(llm, prompts, 16) == hf_greedy(tiny_model, prompts, 16)
