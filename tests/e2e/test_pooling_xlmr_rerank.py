# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""bge-reranker-v2-m3-shaped cross-encoder reranking (tiny ``XLMRobertaForSequenceClassification``, one label)
through ``LLM.score`` on the emulated device, in vLLM's default pooling configuration (PIECEWISE graphs).

vLLM joins query and document with the tokenizer's pair encoding (``<s> q </s></s> d </s>``), pools the CLS state
through the classifier head and applies the sigmoid: scores == HF's ``sigmoid(logits)`` on the same ids (1e-5),
for one query against documents of very different lengths in one batch, and for a list of pairs. Bad input: an
embedding request to a cross-encoder, a pair over ``max_model_len``: a clear error, the engine unharmed.
"""

from __future__ import annotations

import pytest
from npu_testkit import pooling
from npu_testkit.engine import emulated_env, engine

pytestmark = pytest.mark.engine

KIND = "xlmr_rerank"
QUERY = "What is the capital of the land?"
DOCS = [
    "The capital is a great city by the river.",
    "Four score and seven years ago our fathers brought forth on this continent a new nation. " * 8,
    "whale",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
]


@pytest.fixture(scope="module")
def model_dir():
    return pooling.build(KIND)


@pytest.fixture(scope="module")
def llm(model_dir, tmp_path_factory):
    with engine(model_dir, emulated_env(tmp_path_factory.mktemp("xlmr_rerank")), **pooling.llm_kwargs(KIND)) as llm:
        yield llm


def _check_scores(llm, model_dir, query: str, docs: list[str]) -> list[float]:
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    expected = pooling.hf_scores(model_dir, KIND, [pooling.pair_ids(model_dir, query, d) for d in docs])
    assert got == pytest.approx(expected, abs=1e-5), (got, expected)
    return got


def test_cross_encoder_is_served_as_a_scorer(llm):
    cfg = llm.llm_engine.vllm_config
    assert cfg.model_config.is_cross_encoder
    assert cfg.model_config.architecture == "XLMRobertaForSequenceClassification"
    (info,) = llm.collective_rpc("npu_runtime_info")
    assert info["cudagraph_mode"] == "PIECEWISE"


def test_one_query_many_documents_match_hf(llm, model_dir):
    ids = [pooling.pair_ids(model_dir, QUERY, d) for d in DOCS]
    assert ids[0][0] == 0 and ids[0].count(2) == 3  # <s> q </s></s> d </s>
    assert max(map(len, ids)) > 10 * min(map(len, ids))  # long and short pairs in one batch
    scores = _check_scores(llm, model_dir, QUERY, DOCS)
    assert max(scores) - min(scores) > 0.05  # the documents are told apart


def test_pairs_match_hf(llm, model_dir):
    queries = [QUERY, "whale", "It was the best of times"]
    docs = DOCS[:3]
    got = [o.outputs.score for o in llm.score(queries, docs, use_tqdm=False)]
    expected = pooling.hf_scores(model_dir, KIND, [pooling.pair_ids(model_dir, q, d) for q, d in zip(queries, docs)])
    assert got == pytest.approx(expected, abs=1e-5), (got, expected)


def test_embedding_request_to_a_cross_encoder_is_a_clear_error(llm, model_dir):
    with pytest.raises(ValueError, match="Embedding API is not supported by this model.*--convert embed"):
        llm.embed(["hello"], use_tqdm=False)
    _check_scores(llm, model_dir, QUERY, DOCS[:2])


def test_pair_over_max_model_len_is_a_clear_error(llm, model_dir):
    long_doc = "It was the best of times, it was the worst of times. " * 60
    assert len(pooling.pair_ids(model_dir, QUERY, long_doc)) > pooling.MAX_LEN
    with pytest.raises(ValueError, match=f"maximum model length of {pooling.MAX_LEN}"):
        llm.score(QUERY, [long_doc], use_tqdm=False)
    _check_scores(llm, model_dir, QUERY, DOCS[:2])
