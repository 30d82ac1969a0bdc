# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Logits soft-capping and per-layer sliding windows end to end: a tiny Gemma-2 (attention soft-cap 20, window 16
on every other layer, ``query_pre_attn_scalar`` scaling) on real vLLM on the emulated device; greedy tokens equal
HF transformers' (float32, eager attention, the HF implementation that applies the soft-cap).
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine

MAX_TOKENS = 32
LENGTHS = [2, 19, 45, 90]


def _config(**overrides):
    import transformers

    args = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=1024,
        sliding_window=16,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
        tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh",  # real Gemma-2 checkpoints carry both names; vLLM reads this one
    )
    return transformers.Gemma2Config(**{**args, **overrides})


@pytest.fixture(scope="module")
def tiny_gemma2():
    cfg = _config()
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    return build_tiny_model(cfg, std=0.3)


@pytest.fixture(scope="module")
def llm(tiny_gemma2, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("gemma2"))
    with engine(tiny_gemma2, env, max_num_batched_tokens=40) as llm:
        yield llm


def _hf_greedy_eager(model_dir, prompts, max_new_tokens):
    # Eager attention: the HF implementation that applies the soft-cap.
    return hf_greedy(model_dir, prompts, max_new_tokens, attn_implementation="eager")


def test_softcap_and_sliding_layers_reach_the_backend(llm):
    def layers(worker):
        from vllm.attention.layer import Attention

        model = worker.model_runner.model
        return sorted(
            {(m.impl.sliding_window, m.impl.logits_soft_cap) for m in model.modules() if isinstance(m, Attention)},
            key=str,
        )

    assert llm.collective_rpc(layers) == [[(16, 20.0), (None, 20.0)]]


def test_gemma2_greedy_matches_hf(llm, tiny_gemma2):
    prompts = make_prompts(LENGTHS, seed=51)
    assert greedy(llm, prompts, MAX_TOKENS) == _hf_greedy_eager(tiny_gemma2, prompts, MAX_TOKENS)


def test_softcap_changes_the_output(tiny_gemma2):
    # Guard against a vacuous pass: the same weights without the attention soft-cap continue differently.
    uncapped = build_tiny_model(_config(attn_logit_softcapping=None), std=0.3)
    prompts = make_prompts(LENGTHS[2:], seed=51)
    assert _hf_greedy_eager(uncapped, prompts, MAX_TOKENS) != _hf_greedy_eager(tiny_gemma2, prompts, MAX_TOKENS)
