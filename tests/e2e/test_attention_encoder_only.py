# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Encoder-only (bidirectional) attention end to end: a tiny BERT embedding model on real vLLM (pooling runner) on
the emulated device; mean-pooled, normalised embeddings match HF transformers with cosine >= 0.9999.

vLLM runs BERT's ``EncoderOnlyAttention`` through the platform's attention backend (wrapped by vLLM's encoder-only
builder, ``causal=False``); the backend's ``encoder_attention`` kernel attends within each sequence, both ways.
"""

from __future__ import annotations

import pytest
from npu_testkit.engine import emulated_env, engine, make_prompts, token_prompts
from npu_testkit.models import build_tiny_model

pytestmark = pytest.mark.engine

LENGTHS = [1, 7, 33, 120]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    import torch
    import transformers

    cfg = transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=512,
        hidden_act="gelu",
    )
    base = build_tiny_model(cfg, auto_class="AutoModel", std=0.2)
    # The generic initialiser leaves BERT's LayerNorm gains near 0 (it only recognises lower-case "norm"), which
    # makes every embedding collapse onto the LayerNorm bias; give them O(1) gains so embeddings depend on the input.
    model = transformers.AutoModel.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm.weight" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    out = tmp_path_factory.mktemp("tiny_bert")
    model.save_pretrained(out, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llm(tiny_bert, tmp_path_factory):
    from vllm.config import PoolerConfig

    env = emulated_env(tmp_path_factory.mktemp("bert"))
    pooler = PoolerConfig(pooling_type="MEAN", normalize=True)
    with engine(tiny_bert, env, runner="pooling", pooler_config=pooler) as llm:
        yield llm


def _hf_embeddings(model_dir, prompts, causal=False):
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            inp = torch.tensor([ids])
            mask = torch.ones_like(inp)
            if causal:  # a [1, L, L] mask: HF BERT then attends causally (the wrong answer, for the guard)
                mask = torch.ones(1, len(ids), len(ids), dtype=torch.long).tril()
            hidden = model(input_ids=inp, attention_mask=mask).last_hidden_state[0]
            out.append(torch.nn.functional.normalize(hidden.mean(0), dim=-1))
    return out


def test_encoder_only_layers_use_our_backend(llm):
    (info,) = llm.collective_rpc("npu_runtime_info")
    backends = info["attention_backends"]
    assert backends and all(b.endswith("AscendAttentionBackend") for b in backends), backends


def test_bert_embeddings_match_hf(llm, tiny_bert):
    import torch

    prompts = make_prompts(LENGTHS, seed=4, vocab_size=500)
    got = [torch.tensor(o.outputs.embedding) for o in llm.embed(token_prompts(prompts), use_tqdm=False)]
    expected = _hf_embeddings(tiny_bert, prompts)
    cosines = [float(torch.nn.functional.cosine_similarity(g, e, dim=0)) for g, e in zip(got, expected)]
    assert min(cosines) >= 0.9999, cosines
    # Guards against a vacuous pass: causal attention would not match, and different prompts differ clearly.
    wrong = _hf_embeddings(tiny_bert, prompts[3:], causal=True)[0]
    assert float(torch.nn.functional.cosine_similarity(got[3], wrong, dim=0)) < 0.999
    for i in range(len(got)):
        for j in range(i):
            assert float(torch.nn.functional.cosine_similarity(got[i], got[j], dim=0)) < 0.99, (i, j)
