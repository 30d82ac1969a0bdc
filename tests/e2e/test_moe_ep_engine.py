# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Expert parallelism in a real vLLM engine on the emulated device: tiny Qwen3-MoE, TP=2 with
``enable_expert_parallel`` (two spawned workers, gloo through NPUCommunicator), float32.

vLLM's default EP: both ranks hold the same tokens, each owns 3 of the 6 experts; npu-ops' ``LocalDispatcher``
runs only the local experts (a partial sum) and vLLM's all-reduce after the MoE adds the ranks up. Reference: HF
transformers, greedy.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
from npu_testkit.engine import ep2_engine, greedy, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

# collective_rpc pickles _moe_layers for the spawned workers, which cannot import this test module by name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("qwen3_moe"))


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    with ep2_engine(tiny_model, tmp_path_factory.mktemp("moe_ep2")) as llm:
        yield llm


def _moe_layers(worker):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    model = worker.model_runner.get_model()
    return [
        (
            type(m).__name__,
            m.ep_rank,
            m.ep_size,
            m.local_num_experts,
            type(m.moe_plan.dispatcher).__name__,
            m.expert_map.tolist(),
            tuple(m.w13_weight.shape),
        )
        for m in model.modules()
        if isinstance(m, FusedMoE)
    ]


def test_experts_are_split_over_two_ranks(llm):
    per_rank = llm.collective_rpc(_moe_layers)
    assert len(per_rank) == 2
    maps = {0: [0, 1, 2, -1, -1, -1], 1: [-1, -1, -1, 0, 1, 2]}
    for layers in per_rank:
        assert len(layers) == 2
        for name, rank, size, local, dispatcher, expert_map, w13_shape in layers:
            assert (name, size, local, dispatcher) == ("AscendFusedMoE", 2, 3, "LocalDispatcher")
            assert expert_map == maps[rank] and w13_shape == (3, 64, 64)
    assert sorted(layers[0][1] for layers in per_rank) == [0, 1]


def test_ep2_greedy_matches_hf(llm, tiny_model):
    prompts = make_prompts([1, 5, 8, 40, 150], seed=1)
    assert greedy(llm, prompts, 16) == hf_greedy(tiny_model, prompts, 16)
