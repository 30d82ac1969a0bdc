# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Dense linear schemes end to end: a tiny Qwen2 (hidden 64, 2 layers, GQA, qkv bias) quantized by ``vllm-npu quantize``
for every linear scheme runs through real vLLM 0.11 on the emulated device with the ``ascend`` method. One engine
per scheme (module-scoped parameters); the checks are in :mod:`npu_testkit.quant_e2e`.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine
from npu_testkit.quant_e2e import (
    PROMPTS,
    QuantCase,
    check_greedy,
    check_logprobs,
    dense_methods,
    layer_methods,
    quantize,
)

pytestmark = pytest.mark.engine

CASES = [
    # KL(float || quantized) measured on this model: W8A8 0.022, W8A8_DYNAMIC 0.010, W4A8 0.89, W4A4 1.39 nats
    # (int4 weights on a random 64-wide model lose far more than on real checkpoints).
    QuantCase("w8a8", "W8A8", "qwen2", 0.1, dense_methods("W8A8Scheme")),
    QuantCase("w8a8_dynamic", "W8A8_DYNAMIC", "qwen2", 0.05, dense_methods("W8A8DynamicScheme")),
    QuantCase("w4a8_dynamic", "W4A8_DYNAMIC", "qwen2", 2.0, dense_methods("W4A8DynamicScheme")),
    QuantCase("w4a4_flatquant", "W4A4_FLATQUANT", "qwen2", 3.0, dense_methods("W4A4FlatQuantScheme")),
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
