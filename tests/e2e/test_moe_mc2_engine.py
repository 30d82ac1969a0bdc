# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""MC2 in a real vLLM engine on the emulated device: tiny Qwen3-MoE, TP=2 with ``enable_expert_parallel`` (two
spawned workers, gloo), float32, ``npu.moe_mc2='on'``.

Both ranks hold the same tokens: MC2's twin sends each rank's share of the tokens to the experts' owners and vLLM's
all-reduce after the MoE assembles the shares. The capacity is ``max_num_seqs`` (16) tokens per step, so decode
steps run MC2 and larger prefill chunks the local (all-gather) dispatcher: both must give HF's greedy tokens.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
from npu_testkit.engine import ep2_engine, greedy, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("qwen3_moe"))


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    with ep2_engine(
        tiny_model, tmp_path_factory.mktemp("moe_mc2"), additional_config={"npu": {"moe_mc2": "on"}}
    ) as llm:
        yield llm


def _mc2_state(worker):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    model = worker.model_runner.get_model()
    return [
        (type(m.moe_plan.dispatcher).__name__, m.moe_plan.mc2.max_tokens_per_rank, dict(m.moe_plan.dispatcher.calls))
        for m in model.modules()
        if isinstance(m, FusedMoE)
    ]


def test_mc2_greedy_matches_hf(llm, tiny_model):
    prompts = make_prompts([1, 5, 8, 40, 150], seed=1)
    assert greedy(llm, prompts, 16) == hf_greedy(tiny_model, prompts, 16)
    for layers in llm.collective_rpc(_mc2_state):
        assert len(layers) == 2
        for name, per_rank, calls in layers:
            assert (name, per_rank) == ("StepDispatcher", 8)  # capacity 16 tokens, half per rank
            assert calls["mc2"] > 0 and calls["other"] > 0  # decode steps MC2, prefill chunks above 16 tokens not
