# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""End to end: tiny Qwen2 and Llama (GQA 4/2 heads, 2 layers) on the emulated device with the ops layer's overrides in
the model, greedy tokens equal to HF transformers (float32). One engine per architecture (module-scoped params).

The model tree is inspected inside the worker (``LLM.apply_model``): every norm, activation, RoPE, linear,
embedding, LM head and logits module must be our class dispatching to ``forward_oot`` with the reference kernel,
and the rotary cos/sin must be gathered once per forward (calls = layers x gathers).
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

ARCHS = ("qwen2", "llama")
EXPECTED = {
    "model.embed_tokens": "NPUVocabParallelEmbedding",
    "model.layers.0.input_layernorm": "NPURMSNorm",
    "model.layers.0.post_attention_layernorm": "NPURMSNorm",
    "model.layers.0.self_attn.qkv_proj": "QKVParallelLinear",  # vLLM's linear layers: float weights stay ND
    "model.layers.0.self_attn.o_proj": "RowParallelLinear",
    "model.layers.0.self_attn.rotary_emb": "NPURotaryEmbedding",
    "model.layers.0.mlp.gate_up_proj": "MergedColumnParallelLinear",
    "model.layers.0.mlp.down_proj": "RowParallelLinear",
    "model.layers.0.mlp.act_fn": "NPUSiluAndMul",
    "model.norm": "NPURMSNorm",
    "lm_head": "NPUParallelLMHead",
    "logits_processor": "NPULogitsProcessor",
}


def describe_model(model):
    """(class name, dispatch target, kernel names, quant method) per module, run inside the worker."""
    out = {}
    for name, mod in model.named_modules():
        fwd = getattr(mod, "_forward_method", None)
        kernels = sorted(
            f"{k}={getattr(v, '__name__', '?')}"
            for k, v in vars(mod).items()
            if k in ("_norm", "_add_norm", "_kernel", "_rotary_mul")
        )
        qm = getattr(mod, "quant_method", None)
        out[name] = (
            type(mod).__name__,
            getattr(fwd, "__name__", None),
            kernels,
            type(qm).__name__ if qm is not None else None,
        )
    return out


def install_rope_counter(model):
    rope = model.model.layers[0].self_attn.rotary_emb
    shared = all(layer.self_attn.rotary_emb is rope for layer in model.model.layers)
    rope._test_calls = 0

    def count(module, args):
        module._test_calls += 1

    rope._test_hook = rope.register_forward_pre_hook(count)
    rope._test_gathers0 = rope._cos_sin.computed
    return shared, len(model.model.layers)


def read_rope_counter(model):
    rope = model.model.layers[0].self_attn.rotary_emb
    rope._test_hook.remove()
    return rope._test_calls, rope._cos_sin.computed - rope._test_gathers0


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(arch):
    return build_tiny_model(tiny_config(arch))


@pytest.fixture(scope="module")
def llm(arch, model_dir, tmp_path_factory):
    with engine(model_dir, emulated_env(tmp_path_factory.mktemp(arch)), max_num_batched_tokens=64) as llm:
        yield llm


def test_model_is_built_from_our_ops(llm):
    (tree,) = llm.apply_model(describe_model)
    for name, cls in EXPECTED.items():
        assert tree[name][0] == cls, (name, tree[name])
    for name in ("model.layers.0.input_layernorm", "model.layers.0.self_attn.rotary_emb", "model.layers.0.mlp.act_fn"):
        assert tree[name][1] == "forward_oot", (name, tree[name])
    assert tree["model.layers.0.input_layernorm"][2] == ["_add_norm=add_rms_norm_reference", "_norm=rms_norm_reference"]
    assert tree["model.layers.0.mlp.act_fn"][2] == ["_kernel=swiglu_reference"]
    assert tree["model.layers.0.self_attn.rotary_emb"][2] == ["_rotary_mul=rotary_mul_reference"]
    assert tree["model.layers.1.self_attn.qkv_proj"][3] == "UnquantizedLinearMethod"
    assert tree["lm_head"][3] == "NPUUnquantizedEmbeddingMethod"
    # Nothing of vLLM's own RMSNorm/SiluAndMul/RotaryEmbedding classes is left in the model.
    leftovers = {n: v[0] for n, v in tree.items() if v[0] in ("RMSNorm", "SiluAndMul", "RotaryEmbedding")}
    assert not leftovers, leftovers


def test_greedy_matches_hf_with_cos_sin_once_per_forward(llm, model_dir):
    prompts = make_prompts([1, 7, 40, 150], seed=3)
    ((shared, layers),) = llm.apply_model(install_rope_counter)
    ours = greedy(llm, prompts, 16)
    ((calls, gathers),) = llm.apply_model(read_rope_counter)
    assert ours == hf_greedy(model_dir, prompts, 16)
    assert shared
    assert gathers > 0 and calls == layers * gathers, (calls, gathers)
