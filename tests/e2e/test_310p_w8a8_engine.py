# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A static W8A8 checkpoint (``vllm-npu quantize --scheme W8A8`` of the tiny Qwen2) served in float16 on the emulated
Ascend 310P: the linear layers take the 310P layout (``[N, K]`` int8 weights, the matmul on their transpose) and the
310P layout gives exactly the A2/A3 layout's answer inside the engine; each prompt's next token is the quant
simulation's and the KL divergence from the float model stays within the A2 test's bound. Log-probs are not compared
to the float32 simulation to 1e-3 as in the float32 A2 test: in float16 they differ by up to 0.37 on this random
64-wide model (activations quantized with a float16 ``1 / input_scale`` flip int8 steps, test_schemes.py), and greedy
runs diverge after a few tokens for the same reason. A W8A8_DYNAMIC checkpoint of the same model is refused by name
at config time (no documented per-token quantization on the chip). One engine.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, make_llm, patched_environ
from npu_testkit.quant_e2e import PROMPTS, QuantCase, dense_methods, layer_methods, next_token_logprobs, quantize
from vllm_npu.interface import reset_chip

pytestmark = pytest.mark.engine

SOC = {"VLLM_NPU_EMULATED_SOC": "310P"}
CASE = QuantCase("w8a8", "W8A8", "qwen2", 0.1, dense_methods("W8A8Scheme"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return quantize(CASE, tmp_path_factory.mktemp("quant"))


@pytest.fixture(scope="module")
def llm(checkpoints, tmp_path_factory):
    with patched_environ(SOC):
        reset_chip()
        env = emulated_env(tmp_path_factory.mktemp("p310q"), extra=SOC)
        try:
            with engine(checkpoints[1], env, dtype="float16", max_logprobs=-1) as llm:
                yield llm
        finally:
            reset_chip()
    reset_chip()


def weight_layouts(worker):
    """Inside the worker: ``(layer, weight shape, output size, input size)`` of the quantized linears."""
    model = worker.model_runner.get_model()
    qkv = model.model.layers[0].self_attn.qkv_proj
    down = model.model.layers[0].mlp.down_proj
    return [
        (tuple(m.weight.shape), m.output_size_per_partition, m.input_size_per_partition, str(m.weight.dtype))
        for m in (qkv, down)
    ]


def test_w8a8_linears_take_the_310p_layout(llm):
    (methods,) = llm.collective_rpc(layer_methods)
    assert methods == CASE.methods
    (layouts,) = llm.collective_rpc(weight_layouts)
    for shape, n, k, dtype in layouts:
        assert shape == (n, k) and dtype == "torch.int8"  # [N, K]: untransposed on a 310P


def layout_agreement(worker):
    """Inside the worker: each quantized linear of layer 0 on a fixed float16 input, in the 310P layout and then in the
    A2/A3 one (the same int8 weight transposed to ``[K, N]``): the max difference of the two outputs."""
    import torch

    model = worker.model_runner.get_model()
    diffs = []
    for m in (model.model.layers[0].self_attn.qkv_proj, model.model.layers[0].mlp.down_proj):
        x = torch.randn(5, m.input_size_per_partition, generator=torch.Generator().manual_seed(0)).half()
        y310 = m.quant_method.apply(m, x, None)
        scheme, weight = m.quant_method.scheme, m.weight.data
        scheme._chip_310p, m.weight.data = False, weight.t().contiguous()
        try:
            y_a2 = m.quant_method.apply(m, x, None)
        finally:
            scheme._chip_310p, m.weight.data = True, weight
        diffs.append(float((y310.float() - y_a2.float()).abs().max()))
    return diffs


def test_the_310p_layout_gives_the_a2_layouts_answer_exactly(llm):
    (diffs,) = llm.collective_rpc(layout_agreement)
    assert diffs == [0.0, 0.0]


def test_float16_next_tokens_match_the_simulation_and_stay_close_to_float(llm, checkpoints):
    from npu_testkit.models import hf_logprobs
    from vllm_npu.quant.tools.simulate import logprobs as sim_logprobs
    from vllm_npu.quant.tools.simulate import simulated_hf_model

    simulated = simulated_hf_model(checkpoints[1])
    for prompt in PROMPTS:
        sim = sim_logprobs(simulated, prompt)[-1]
        got = next_token_logprobs(llm, prompt, sim.shape[0])
        assert int(got.argmax()) == int(sim.argmax())
        ref = hf_logprobs(checkpoints[0], prompt)[-1]
        assert float((ref.exp() * (ref - got)).sum()) <= CASE.kl_bound


def test_a_w8a8_dynamic_checkpoint_is_refused_by_name(llm, tmp_path):
    # Per-token dynamic quantization has no documented 310P kernel (docs/310p.md, "Quantization"): `vllm serve` of
    # such a checkpoint stops at config time (the module's engine is up; this one fails before any worker exists).
    _, dynamic = quantize(QuantCase("w8a8_dynamic", "W8A8_DYNAMIC", "qwen2", 0.05, []), tmp_path)
    with (
        patched_environ(SOC),
        pytest.raises(Exception, match=r"uses W8A8_DYNAMIC, which is not supported on the Atlas"),
    ):
        make_llm(dynamic, dtype="float16")
