# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A static expert placement (``npu.expert_map_path``) in a real vLLM engine on the emulated device: tiny Qwen3-MoE
(6 experts, top-2), TP=2 with ``enable_expert_parallel``, float32, ``npu.moe_mc2='on'``.

The map swaps experts across the ranks and replicates experts 0 and 3 on both (8 slots for 6 experts): each rank
loads its 4 slots from the checkpoint's logical experts, and each routed expert goes to one replica. Decode steps
run through MC2, prefill chunks through the local dispatcher: greedy tokens must equal HF's.
"""

from __future__ import annotations

import json
import sys

import cloudpickle
import pytest
from npu_testkit.engine import ep2_engine, greedy, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SLOTS = {0: [3, 1, 5, 0], 1: [2, 4, 0, 3]}


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_config("qwen3_moe"))


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_static_map")
    layer = {"device_count": 2, "device_list": [{"device_id": r, "device_expert": e} for r, e in SLOTS.items()]}
    path = root / "expert_map.json"
    path.write_text(json.dumps({"moe_layer_count": 2, "layer_list": [{"layer_id": i, **layer} for i in range(2)]}))
    with ep2_engine(
        tiny_model, root, additional_config={"npu": {"expert_map_path": str(path), "moe_mc2": "on"}}
    ) as llm:
        yield llm


def _placement(worker):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    model = worker.model_runner.get_model()
    return [
        (
            m.ep_rank,
            m.local_num_experts,
            m.expert_map.tolist(),
            tuple(m.w13_weight.shape),
            dict(m.moe_plan.dispatcher.calls),
        )
        for m in model.modules()
        if isinstance(m, FusedMoE)
    ]


def test_static_map_with_swapped_and_redundant_experts_matches_hf(llm, tiny_model):
    prompts = make_prompts([1, 5, 8, 40, 150], seed=2)
    assert greedy(llm, prompts, 16) == hf_greedy(tiny_model, prompts, 16)
    ranks = set()
    for layers in llm.collective_rpc(_placement):
        assert len(layers) == 2
        for rank, local, expert_map, w13_shape, calls in layers:
            ranks.add(rank)
            expect = [-1] * 6
            for slot, e in enumerate(SLOTS[rank]):
                expect[e] = slot
            assert (local, expert_map, w13_shape) == (4, expect, (4, 64, 64))
            assert calls["mc2"] > 0 and calls["other"] > 0
    assert ranks == {0, 1}
