# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""DeepSeek MTP (2 draft tokens) on a W8A8_DYNAMIC msModelSlim-format checkpoint written by ``vllm-npu quantize``
from a tiny DeepSeek-V3 with one MTP layer, on the emulated device.

The quantizer carries the MTP layer over (HF transformers never loads it): its decoder-block linears quantized like
the decoder layers', ``eh_proj`` and ``shared_head`` FLOAT. vLLM 0.11 builds the MTP layer's shared head without a
prefix (vllm-project/vllm#25805 adds it; vllm-ascend v0.11.0 patches it in ``patch_deepseek_mtp.py``); npu-quant
needs no patch for it: an embedding / LM head the description does not name stays in floating point, which is what
msModelSlim writes for ``shared_head.head``. Greedy tokens with speculation equal the pure-torch simulation of the
quantized target (``vllm_npu.quant.tools.simulate``).
"""

from __future__ import annotations

import json

import pytest
from npu_testkit.drafts import build_mtp_model
from npu_testkit.engine import make_prompts, tiny_config
from npu_testkit.quant_e2e import MAX_TOKENS
from npu_testkit.spec_e2e import greedy_counted, spec_engine

pytestmark = pytest.mark.engine

K = 2


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from vllm_npu.quant.tools.cli import main as quantize_main

    out = tmp_path_factory.mktemp("mtpq") / "w8a8_dynamic"
    assert quantize_main([str(build_mtp_model(tiny_config("deepseek_v3"))), str(out), "--scheme", "W8A8_DYNAMIC"]) == 0
    return out


@pytest.fixture(scope="module")
def llm(quantized, tmp_path_factory):
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": K}
    with spec_engine(quantized, tmp_path_factory.mktemp("mtpq_engine"), spec) as llm:
        yield llm


def test_quantizer_writes_the_mtp_layer(quantized):
    desc = json.loads((quantized / "quant_model_description.json").read_text())
    mtp = {k: v for k, v in desc.items() if k.startswith("model.layers.2.")}
    assert mtp["model.layers.2.self_attn.q_a_proj.weight"] == "W8A8_DYNAMIC"
    assert mtp["model.layers.2.self_attn.q_a_proj.weight_scale"] == "W8A8_DYNAMIC"
    assert mtp["model.layers.2.mlp.experts.0.gate_proj.weight"] == "W8A8_DYNAMIC"
    assert mtp["model.layers.2.mlp.gate.weight"] == "FLOAT"  # the router
    for name in ("eh_proj", "shared_head.head", "shared_head.norm", "enorm", "hnorm", "embed_tokens"):
        assert mtp[f"model.layers.2.{name}.weight"] == "FLOAT", name


def test_mtp_on_quantized_target_matches_simulation(llm, quantized):
    from vllm_npu.quant.tools.simulate import greedy as sim_greedy
    from vllm_npu.quant.tools.simulate import simulated_hf_model

    # MAX_TOKENS of the quant e2e suite: the simulation is a different implementation (log-probs within 1e-3), so
    # over long continuations a near tie can go either way, with or without speculation
    prompts = make_prompts([5, 30, 12, 60], seed=1)
    got = greedy_counted(llm, prompts, MAX_TOKENS)
    assert got.tokens == sim_greedy(simulated_hf_model(quantized), prompts, MAX_TOKENS)
    assert got.drafted > 0 and got.accepted < got.drafted
