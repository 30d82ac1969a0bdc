"""End to end: a tiny Qwen3-MoE (6 experts, top-2, every layer MoE) quantized by ``vllm-npu quantize --scheme W4A8_DYNAMIC
--w4a8-version 1.0.0`` (the packed format: two int4 values per int8, experts included) runs through real vLLM 0.11 on the
emulated device with the ``ascend`` quant method (selected from the checkpoint: no ``quantization=`` argument).

Checks (float32; prompts of 1, 5 and 20 tokens; 8 greedy tokens):

- attention linears and the experts run W4A8_DYNAMIC (int4 weights, group 32; experts through npu-ops' MoE forward and the per-group int4 grouped matmul); the router stays float;
- greedy output equals, token for token, a pure-torch model running the same checkpoint tensors
  (:func:`vllm_npu.quant.simulate.simulated_hf_model`: HF transformers with every quantized linear replaced by the
  scheme's maths written out independently of the kernels);
- next-token log-probs over the whole vocabulary equal the simulation's within 1e-3 (max abs), and stay close to the
  float model's: KL(float || quantized) <= 0.5 nats (measured 0.07 / 0.22 / 0.11; int4 weights on a random 64-wide
  model; max |Δ| vs the simulation 3e-6).
"""

from __future__ import annotations

import pytest
import torch
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, token_prompts
from npu_testkit.models import build_tiny_model, hf_logprobs

pytestmark = pytest.mark.engine

SCHEME = "W4A8_DYNAMIC"
KL_BOUND = 0.5
PROMPTS = make_prompts([1, 5, 20], seed=1)
MAX_TOKENS = 8


def tiny_qwen3_moe():
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from vllm_npu.quant.cli import main as quantize_main

    float_dir = build_tiny_model(tiny_qwen3_moe())
    quant_dir = tmp_path_factory.mktemp("quant") / SCHEME
    assert quantize_main([str(float_dir), str(quant_dir), "--scheme", SCHEME, "--w4a8-version", "1.0.0"]) == 0
    return float_dir, quant_dir


def test_checkpoint_experts_are_packed(checkpoints):
    from safetensors.torch import load_file
    from vllm_npu.quant.description import QuantDescription

    quant_dir = checkpoints[1]
    assert QuantDescription.from_file(quant_dir / "quant_model_description.json").version == "1.0.0"
    state = load_file(str(quant_dir / "quant_model_weights.safetensors"))
    expert = "model.layers.0.mlp.experts.0"
    assert state[f"{expert}.gate_proj.weight"].shape == (16, 64)  # [I/2, H], I = 32
    assert state[f"{expert}.down_proj.weight"].shape == (32, 32)  # [H/2, I], H = 64
    assert state[f"{expert}.down_proj.scale_bias"].shape == (64, 16)


@pytest.fixture(scope="module")
def simulated(checkpoints):
    from vllm_npu.quant.simulate import simulated_hf_model

    return simulated_hf_model(checkpoints[1])


@pytest.fixture(scope="module")
def llm(checkpoints, tmp_path_factory):
    with engine(checkpoints[1], emulated_env(tmp_path_factory.mktemp("vllm")), max_logprobs=-1) as llm:
        yield llm


def _quant_methods(worker):
    from vllm.model_executor.layers.fused_moe import FusedMoE
    from vllm.model_executor.layers.linear import LinearBase

    model = worker.model_runner.get_model()
    found = set()
    for name, m in model.named_modules():
        if isinstance(m, (LinearBase, FusedMoE)):
            method = type(m.quant_method).__name__
            scheme = type(getattr(m.quant_method, "scheme", None)).__name__
            found.add((name.rsplit(".", 1)[-1], "float" if "Unquantized" in method else method, scheme))
    return sorted(found)


def _next_token_logprobs(llm, prompt: list[int], vocab: int) -> torch.Tensor:
    from vllm import SamplingParams

    out = llm.generate(token_prompts([prompt]), SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1),
                       use_tqdm=False)
    lp = torch.full((vocab,), float("-inf"))
    for token, logprob in out[0].outputs[0].logprobs[0].items():
        lp[token] = logprob.logprob
    return lp


def test_quantized_layers_run_the_scheme(llm):
    (methods,) = llm.collective_rpc(_quant_methods)
    assert methods == [("experts", "AscendW4A8DynamicFusedMoEMethod", "NoneType"), ("gate", "float", "NoneType"),
                       ("o_proj", "AscendLinearMethod", "W4A8DynamicScheme"), ("qkv_proj", "AscendLinearMethod", "W4A8DynamicScheme")]


def test_generates_and_matches_simulation(llm, simulated):
    from vllm_npu.quant.simulate import greedy as sim_greedy

    got = greedy(llm, PROMPTS, MAX_TOKENS)
    assert all(len(g) == MAX_TOKENS for g in got)
    assert got == sim_greedy(simulated, PROMPTS, MAX_TOKENS)


def test_logprobs_match_simulation_and_stay_close_to_float(llm, simulated, checkpoints):
    from vllm_npu.quant.simulate import logprobs as sim_logprobs

    float_dir, _ = checkpoints
    for prompt in PROMPTS:
        sim = sim_logprobs(simulated, prompt)[-1]
        got = _next_token_logprobs(llm, prompt, sim.shape[0])
        assert float((got - sim).abs().max()) <= 1e-3
        ref = hf_logprobs(float_dir, prompt)[-1]
        kl = float((ref.exp() * (ref - got)).sum())
        assert kl <= KL_BOUND, f"KL(float || {SCHEME}) = {kl:.4f} > {KL_BOUND} for a {len(prompt)}-token prompt"
