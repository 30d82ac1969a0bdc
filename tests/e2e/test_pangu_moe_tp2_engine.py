# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""PanguProMoEForCausalLM at tensor_parallel_size=2 with expert parallelism on the emulated device (two spawned
workers, gloo through NPUCommunicator), float32.

The tiny model has 8 experts in 2 MoGE groups (top-2, one expert per group); with EP over 2 ranks each rank owns
exactly one group, so every token sends one (token, expert) pair to each rank: the balance MoGE is designed for.
Attention heads (4 query / 2 KV) split over the ranks. Reference: the float64 implementation in
``pangu_moe_reference.py``, greedy (the same one the TP=1 module compares with).
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
from npu_testkit.engine import ep2_engine, greedy, make_prompts
from npu_testkit.pangu import build_tiny_pangu, load_tensors

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from pangu_moe_reference import PanguReference  # noqa: E402

pytestmark = pytest.mark.engine

# collective_rpc pickles _moe_layers for the spawned workers, which cannot import this test module by name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MAX_TOKENS = 16
PROMPTS = make_prompts([1, 5, 8, 40, 150], seed=1)


@pytest.fixture(scope="module")
def tiny_pangu():
    return build_tiny_pangu()


@pytest.fixture(scope="module")
def llm(tiny_pangu, tmp_path_factory):
    with ep2_engine(tiny_pangu, tmp_path_factory.mktemp("pangu_ep2")) as llm:
        yield llm


def _moe_layers(worker):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    model = worker.model_runner.get_model()
    return [
        (
            type(m).__name__,
            m.ep_rank,
            m.ep_size,
            type(m.moe_plan.dispatcher).__name__,
            m.expert_map.tolist(),
            tuple(m.w13_weight.shape),
        )
        for m in model.modules()
        if isinstance(m, FusedMoE)
    ]


def test_each_rank_owns_one_expert_group(llm):
    per_rank = llm.collective_rpc(_moe_layers)
    maps = {0: [0, 1, 2, 3, -1, -1, -1, -1], 1: [-1, -1, -1, -1, 0, 1, 2, 3]}
    assert len(per_rank) == 2
    for layers in per_rank:
        assert len(layers) == 2
        for name, rank, size, dispatcher, expert_map, w13_shape in layers:
            assert (name, size, dispatcher) == ("AscendFusedMoE", 2, "LocalDispatcher")
            # MoGE group g is experts 4g..4g+3: rank r holds group r whole (4 local experts, full width 2 x 32).
            assert expert_map == maps[rank] and w13_shape == (4, 64, 64)
    assert sorted(layers[0][1] for layers in per_rank) == [0, 1]


def test_tp2_ep_greedy_matches_the_float64_reference(llm, tiny_pangu):
    reference = PanguReference(*load_tensors(tiny_pangu))
    expected = [reference.greedy(p, MAX_TOKENS)[0] for p in PROMPTS]
    assert greedy(llm, PROMPTS, MAX_TOKENS) == expected
