# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device with a tiny Qwen3-MoE model (softmax top-2 of 6 experts), float32.

Every decoder layer is MoE, and the 6 experts (not a power of two) run through npu-ops' AscendFusedMoE: softmax
top-k gate, init_routing, grouped matmul + swiglu, unpermute (reference kernels). Reference: HF transformers
``Qwen3MoeForCausalLM``, float32, greedy; batched prompts of very different lengths and chunked prefill.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("qwen3_moe"))


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("qwen3_moe"))
    with engine(tiny_model, env, max_num_batched_tokens=64) as llm:
        yield llm


def _moe_layers(worker):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    model = worker.model_runner.get_model()
    return [
        (
            f"{type(m).__module__}.{type(m).__name__}",
            type(m.quant_method).__name__,
            m.moe_plan.gate_path,
            type(m.moe_plan.dispatcher).__name__,
        )
        for m in model.modules()
        if isinstance(m, FusedMoE)
    ]


def test_our_moe_class_is_in_the_model(llm):
    (layers,) = llm.collective_rpc(_moe_layers)
    assert (
        layers
        == [
            (
                "vllm_npu.ops.moe.layer.AscendFusedMoE",
                "AscendUnquantizedFusedMoEMethod",
                "topk_softmax",
                "LocalDispatcher",
            )
        ]
        * 2
    )


def test_batched_prompts_match_hf(llm, tiny_model):
    prompts = make_prompts([1, 5, 8, 40, 150], seed=1)  # the 150-token prompt is prefilled in chunks of 64
    assert greedy(llm, prompts, 16) == hf_greedy(tiny_model, prompts, 16)
