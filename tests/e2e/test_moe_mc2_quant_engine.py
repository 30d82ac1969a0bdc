# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""W8A8_DYNAMIC MoE through MC2 in a real vLLM engine on the emulated device: the tiny Qwen3-MoE quantized by
``vllm-npu quantize``, TP=2 with ``enable_expert_parallel``, ``npu.moe_mc2='on'``, and a static placement with a
redundant replica per rank (so the quant MoE method runs the logical -> physical choice too).

MC2 dispatches in its dynamic-quant mode (rows travel as int8 with per-token scales; the experts skip their own
first quantisation), which is the same maths, so greedy tokens must equal the pure-torch quant simulation's. The
attention linears are turned back to float in the checkpoint: split over TP=2, a W8A8_DYNAMIC o_proj quantises each
rank's half of its input with its own per-token scale, which no single-process simulation reproduces (the experts
are whole on their rank under expert parallelism, so they are exact).
"""

from __future__ import annotations

import json
import sys

import cloudpickle
import pytest
from npu_testkit.engine import ep2_engine
from npu_testkit.quant_e2e import QuantCase, check_greedy, layer_methods, moe_methods
from npu_testkit.quant_ep import quantized_experts_only

pytestmark = pytest.mark.engine

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CASE = QuantCase(
    "moe_w8a8_dynamic_mc2",
    "W8A8_DYNAMIC",
    "qwen3_moe",
    0.05,
    moe_methods("AscendW8A8DynamicFusedMoEMethod", "W8A8DynamicScheme"),
)
SLOTS = {0: [0, 1, 2, 5], 1: [3, 4, 5, 1]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return quantized_experts_only(CASE, tmp_path_factory.mktemp("quant"))


@pytest.fixture(scope="module")
def simulated(checkpoints):
    from vllm_npu.quant.tools.simulate import simulated_hf_model

    return simulated_hf_model(checkpoints[1])


@pytest.fixture(scope="module")
def llm(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    layer = {"device_count": 2, "device_list": [{"device_id": r, "device_expert": e} for r, e in SLOTS.items()]}
    path = root / "expert_map.json"
    path.write_text(json.dumps({"layer_list": [{"layer_id": i, **layer} for i in range(2)]}))
    with ep2_engine(
        checkpoints[1], root, additional_config={"npu": {"moe_mc2": "on", "expert_map_path": str(path)}}
    ) as llm:
        yield llm


def _mc2_quant_state(worker):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    model = worker.model_runner.get_model()
    return [
        (
            type(m.quant_method).__name__,
            callable(getattr(m.quant_method._experts, "run_int8", None)),
            m.local_num_experts,
            dict(m.moe_plan.dispatcher.calls),
        )  # fmt: skip
        for m in model.modules()
        if isinstance(m, FusedMoE)
    ]


def test_w8a8_dynamic_through_mc2_matches_simulation(llm, simulated):
    for methods in llm.collective_rpc(layer_methods):  # experts quantized, attention float
        assert ("experts", "AscendW8A8DynamicFusedMoEMethod", "NoneType") in methods
        assert ("o_proj", "float", "NoneType") in methods and ("qkv_proj", "float", "NoneType") in methods
    check_greedy(llm, simulated)
    for layers in llm.collective_rpc(_mc2_quant_state):
        assert len(layers) == 2
        for method, takes_int8, local, calls in layers:
            assert (method, takes_int8, local) == ("AscendW8A8DynamicFusedMoEMethod", True, 4)
            assert calls["mc2"] > 0
