# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Tiny DeepSeek-V3 variant through AscendMLABackend: no q LoRA (``q_proj`` path), YaRN rope scaling (the MLA
softmax scale carries DeepSeek's mscale²) and KV block size 128. One engine; reference: HF transformers, float32.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, greedy, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.engine


def tiny_deepseek_v3_yarn():
    # The testkit's tiny DeepSeek-V3 without q LoRA, with YaRN rope scaling, 2 heads and a smaller latent cache.
    return tiny_config(
        "deepseek_v3",
        intermediate_size=96,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        v_head_dim=12,
        routed_scaling_factor=2.5,
        rope_scaling={
            "type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(tiny_deepseek_v3_yarn())


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    env = emulated_env(tmp_path_factory.mktemp("deepseek_b128"))
    with engine(tiny_model, env, block_size=128, max_num_batched_tokens=64) as llm:
        yield llm


def test_block_size_128_latent_cache(llm):
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["attention_backends"] == ["vllm_npu.attention.backends.mla.AscendMLABackend"]
    assert info["block_size"] == 128 and info["kv_cache_shape"][1:] == (128, 16 + 8)


def _fused_flags(worker) -> list[bool]:
    from vllm_npu.attention.ops.mla_base import VllmMLALayer as MultiHeadLatentAttention  # 0.11.1: ...Wrapper

    model = worker.model_runner.get_model()
    return [m.fused_cache_write for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]


def test_fused_write_with_yarn_rope(llm):
    # DeepSeek's YaRN rope (mscale folded into cos/sin) still goes through the fused norm + rope + write kernel.
    (flags,) = llm.collective_rpc(_fused_flags)
    assert flags == [True, True]


def test_greedy_matches_hf(llm, tiny_model):
    # 200 tokens: 4 prefill chunks of <= 64 tokens crossing the first 128-token block, plus short requests decoding.
    prompts = make_prompts([2, 17, 200], seed=21)
    assert greedy(llm, prompts, 12) == hf_greedy(tiny_model, prompts, 12)
