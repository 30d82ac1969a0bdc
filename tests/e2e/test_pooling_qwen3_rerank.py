# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Qwen3-Reranker-shaped decoder reranking through vLLM 0.11's score conversion, on the emulated device.

The checkpoint is a tiny ``Qwen3ForCausalLM`` whose vocabulary holds the judgement tokens ``no`` and ``yes``;
``hf_overrides`` ``{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"is_original_qwen3_reranker": true}`` make vLLM load it as a sequence classifier whose single score row is
``lm_head[yes] - lm_head[no]`` (``from_2_way_softmax``), pooled at the last token and passed through a sigmoid:
P(yes) of the two-way softmax, what Qwen3-Reranker's model card computes from the causal LM's logits. Scores == HF
on the same ids (1e-5) for Qwen3-Reranker-formatted query/document pairs of very different lengths in one batch.
Bad input: generate on the reranker, an embedding request, a pair over ``max_model_len``: a clear error, the engine
unharmed.
"""

from __future__ import annotations

import pytest
from npu_testkit import pooling
from npu_testkit.engine import emulated_env, engine

pytestmark = pytest.mark.engine

KIND = "qwen3_rerank"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERY = "What is the capital of the land?"
DOCS = [
    "The capital is a great city by the river.",
    "whale",
    "Four score and seven years ago our fathers brought forth on this continent a new nation. " * 6,
]


@pytest.fixture(scope="module")
def model_dir():
    return pooling.build(KIND)


@pytest.fixture(scope="module")
def llm(model_dir, tmp_path_factory):
    with engine(model_dir, emulated_env(tmp_path_factory.mktemp("qwen3_rerank")), **pooling.llm_kwargs(KIND)) as llm:
        yield llm


def _check_scores(llm, model_dir, query: str, docs: list[str]) -> list[float]:
    parts = [pooling.qwen3_rerank_pair(INSTRUCTION, query, d) for d in docs]
    got = [o.outputs.score for o in llm.score(parts[0][0], [p[1] for p in parts], use_tqdm=False)]
    expected = pooling.hf_scores(model_dir, KIND, [pooling.pair_ids(model_dir, q, d) for q, d in parts])
    assert got == pytest.approx(expected, abs=1e-5), (got, expected)
    return got


def test_converted_to_a_sequence_classifier(llm):
    model_config = llm.llm_engine.vllm_config.model_config
    assert model_config.architecture == "Qwen3ForSequenceClassification"
    assert model_config.hf_config.method == "from_2_way_softmax" and model_config.hf_config.num_labels == 1
    assert model_config.pooler_config.pooling_type == "LAST"


def test_formatted_pairs_match_hf_yes_probability(llm, model_dir):
    parts = [pooling.qwen3_rerank_pair(INSTRUCTION, QUERY, d) for d in DOCS]
    lengths = [len(pooling.pair_ids(model_dir, q, d)) for q, d in parts]
    assert max(lengths) - min(lengths) > 150, lengths  # long and short pairs in one batch (same template)
    scores = _check_scores(llm, model_dir, QUERY, DOCS)
    assert max(scores) - min(scores) > 0.01  # the documents are told apart


def test_generate_and_embed_on_the_reranker_are_clear_errors(llm, model_dir):
    with pytest.raises(ValueError, match="only supported for generative models.*--runner generate"):
        llm.generate(["hello"])
    with pytest.raises(ValueError, match="Embedding API is not supported by this model.*--convert embed"):
        llm.embed(["hello"], use_tqdm=False)
    _check_scores(llm, model_dir, QUERY, DOCS[:2])


def test_pair_over_max_model_len_is_a_clear_error(llm, model_dir):
    long_doc = "It was the best of times, it was the worst of times. " * 60
    query, doc = pooling.qwen3_rerank_pair(INSTRUCTION, QUERY, long_doc)
    assert len(pooling.pair_ids(model_dir, query, doc)) > pooling.MAX_LEN
    with pytest.raises(ValueError, match=f"maximum model length of {pooling.MAX_LEN}"):
        llm.score(query, [doc], use_tqdm=False)
    _check_scores(llm, model_dir, QUERY, DOCS[:2])
