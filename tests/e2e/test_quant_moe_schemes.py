# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""MoE schemes end to end: a tiny Qwen3-MoE (6 experts, top-2, every layer MoE) quantized by ``vllm-npu quantize``
runs through real vLLM 0.11 on the emulated device with the ``ascend`` method: attention linears run the linear
scheme, the experts the MoE method through npu-ops' MoE forward, the router stays float. One engine per scheme
(module-scoped parameters); the checks are in :mod:`npu_testkit.quant_e2e`.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine
from npu_testkit.quant_e2e import (
    PROMPTS,
    QuantCase,
    check_greedy,
    check_logprobs,
    layer_methods,
    moe_methods,
    quantize,
)

pytestmark = pytest.mark.engine

CASES = [
    # KL(float || quantized) measured: W8A8 0.0017-0.0047, W8A8_DYNAMIC 0.003, W4A8 0.22, W4A8 packed 0.07-0.22 nats.
    QuantCase("moe_w8a8", "W8A8", "qwen3_moe", 0.05, moe_methods("AscendW8A8FusedMoEMethod", "W8A8Scheme")),
    QuantCase(
        "moe_w8a8_dynamic",
        "W8A8_DYNAMIC",
        "qwen3_moe",
        0.05,
        moe_methods("AscendW8A8DynamicFusedMoEMethod", "W8A8DynamicScheme"),
    ),
    QuantCase(
        "moe_w4a8_dynamic",
        "W4A8_DYNAMIC",
        "qwen3_moe",
        0.5,
        moe_methods("AscendW4A8DynamicFusedMoEMethod", "W4A8DynamicScheme"),
    ),
    QuantCase(
        "moe_w4a8_packed",
        "W4A8_DYNAMIC",
        "qwen3_moe",
        0.5,
        moe_methods("AscendW4A8DynamicFusedMoEMethod", "W4A8DynamicScheme"),
        quantize_args=("--w4a8-version", "1.0.0"),
    ),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def case(request) -> QuantCase:
    return request.param


@pytest.fixture(scope="module")
def checkpoints(case, tmp_path_factory):
    return quantize(case, tmp_path_factory.mktemp("quant"))


@pytest.fixture(scope="module")
def simulated(checkpoints):
    from vllm_npu.quant.tools.simulate import simulated_hf_model

    return simulated_hf_model(checkpoints[1])


@pytest.fixture(scope="module")
def llm(checkpoints, tmp_path_factory):
    with engine(checkpoints[1], emulated_env(tmp_path_factory.mktemp("vllm")), max_logprobs=-1) as llm:
        yield llm


def test_quantized_layers_run_the_scheme(llm, case):
    (methods,) = llm.collective_rpc(layer_methods)
    assert methods == case.methods


def test_generates_and_matches_simulation(llm, simulated):
    check_greedy(llm, simulated)


def test_logprobs_match_simulation_and_stay_close_to_float(llm, simulated, checkpoints, case):
    check_logprobs(llm, simulated, checkpoints[0], case, PROMPTS)


def test_packed_checkpoint_holds_two_int4_per_int8(checkpoints, case):
    from safetensors.torch import load_file
    from vllm_npu.quant.description import QuantDescription

    quant_dir = checkpoints[1]
    description = QuantDescription.from_file(quant_dir / "quant_model_description.json")
    state = load_file(str(quant_dir / "quant_model_weights.safetensors"))
    expert = "model.layers.0.mlp.experts.0"
    if case.id != "moe_w4a8_packed":
        assert description.version != "1.0.0"
        return
    assert description.version == "1.0.0"
    assert state[f"{expert}.gate_proj.weight"].shape == (16, 64)  # [I/2, H], I = 32
    assert state[f"{expert}.down_proj.weight"].shape == (32, 32)  # [H/2, I], H = 64
    assert state[f"{expert}.down_proj.scale_bias"].shape == (64, 16)
