# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Qwen3-Embedding-shaped decoder embeddings (tiny ``Qwen3ForCausalLM`` served with ``runner="pooling"``: vLLM's
embedding adapter, last-token pooling + normalize; the tokenizer appends ``<|endoftext|>`` as Qwen3-Embedding's
does) through ``LLM.embed`` on the emulated device, with chunked prefill on (vLLM allows it for last-token pooling
of a causal model): 64-token steps, so a long input is prefilled in chunks next to short ones.

- embeddings == HF's last hidden state of the last token, normalised (cosine >= 0.9999), token ids of very different
  lengths in one batch, and instruction-formatted queries next to bare documents (Qwen3-Embedding's usage);
- Matryoshka: ``PoolingParams(dimensions=d)`` for each of the config's ``matryoshka_dimensions`` == HF truncated to
  ``d`` then normalised; a dimension outside the list is a clear error;
- ``LLM.score`` on the embedder == cosine of the HF embeddings.
"""

from __future__ import annotations

import pytest
from npu_testkit import pooling
from npu_testkit.engine import emulated_env, engine, make_prompts, token_prompts

pytestmark = pytest.mark.engine

KIND = "qwen3_embed"
LENGTHS = [1, 5, 40, 150, 300]
EOS = 0
TASK = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def model_dir():
    return pooling.build(KIND)


@pytest.fixture(scope="module")
def llm(model_dir, tmp_path_factory):
    kwargs = {**pooling.llm_kwargs(KIND), "enable_chunked_prefill": True, "max_num_batched_tokens": 64}
    with engine(model_dir, emulated_env(tmp_path_factory.mktemp("qwen3_embed")), **kwargs) as llm:
        yield llm


def _prompts(lengths, seed):
    return [[*p, EOS] for p in make_prompts(lengths, seed=seed, vocab_size=500, avoid=(0, 1, 2))]


def _embed(llm, prompts, **params):
    import torch
    from vllm import PoolingParams

    outs = llm.embed(token_prompts(prompts), pooling_params=PoolingParams(**params), use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outs]


def test_served_with_last_token_pooling_and_chunked_prefill(llm):
    cfg = llm.llm_engine.vllm_config
    assert cfg.model_config.pooler_config.pooling_type == "LAST"
    assert cfg.model_config.is_matryoshka and cfg.model_config.matryoshka_dimensions == pooling.QWEN3_MATRYOSHKA
    assert cfg.scheduler_config.chunked_prefill_enabled and cfg.scheduler_config.max_num_batched_tokens == 64


def test_embeddings_match_hf_mixed_lengths_chunked(llm, model_dir):
    prompts = _prompts(LENGTHS, seed=5)
    got = _embed(llm, prompts)
    assert [len(g) for g in got] == [64] * len(prompts)
    cosines = pooling.cosines(got, pooling.hf_embeddings(model_dir, KIND, prompts))
    assert min(cosines) >= 0.9999, cosines
    assert max(pooling.cosines(got[1:], got[:-1])) < 0.99


def test_instruction_queries_and_documents_match_hf(llm, model_dir):
    import torch

    texts = [
        pooling.QWEN3_INSTRUCTION.format(task=TASK, query="What is the capital of the land?"),
        pooling.QWEN3_INSTRUCTION.format(task=TASK, query="Who wrote about the whale?"),
        "The capital is a great city by the river.",
        "Call me Ishmael. Some years ago, never mind how long precisely, I thought I would sail about. " * 3,
    ]
    ids = [pooling.text_ids(model_dir, t) for t in texts]
    assert all(i[-1] == EOS for i in ids)  # the tokenizer appends <|endoftext|>: the pooled token
    got = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]
    cosines = pooling.cosines(got, pooling.hf_embeddings(model_dir, KIND, ids))
    assert min(cosines) >= 0.9999, cosines


@pytest.mark.parametrize("dimensions", pooling.QWEN3_MATRYOSHKA[:-1])
def test_matryoshka_dimensions_match_hf(llm, model_dir, dimensions):
    prompts = _prompts([3, 60, 200], seed=6)
    got = _embed(llm, prompts, dimensions=dimensions)
    assert [len(g) for g in got] == [dimensions] * len(prompts)
    cosines = pooling.cosines(got, pooling.hf_embeddings(model_dir, KIND, prompts, dimensions=dimensions))
    assert min(cosines) >= 0.9999, cosines


def test_dimension_outside_the_matryoshka_list_is_a_clear_error(llm, model_dir):
    with pytest.raises(ValueError, match=r"only supports \[16, 32, 64\] matryoshka dimensions"):
        _embed(llm, _prompts([4], seed=7), dimensions=20)
    test_matryoshka_dimensions_match_hf(llm, model_dir, 16)  # the engine is unharmed


def test_score_on_the_embedder_is_the_cosine_of_hf_embeddings(llm, model_dir):
    query, docs = "What is the capital of the land?", ["The capital is a great city by the river.", "whale"]
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    ids = [pooling.text_ids(model_dir, t) for t in [query, *docs]]
    ref = pooling.hf_embeddings(model_dir, KIND, ids)
    assert got == pytest.approx(pooling.cosines([ref[0], ref[0]], ref[1:]), abs=1e-4)
