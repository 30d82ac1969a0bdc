# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Pooling models over ``vllm serve``'s HTTP API on the emulated device: two servers, one after the other.

- a Qwen3-Embedding-shaped embedder (``--runner pooling``, last-token pooling): ``/v1/embeddings`` == HF (cosine
  >= 0.9999) for a batch of inputs of very different lengths, instruction-formatted queries included, and with a
  Matryoshka ``dimensions``;
- a bge-reranker-v2-m3-shaped cross-encoder: ``/score`` and ``/rerank`` (and ``/v1/rerank``) == HF's sigmoid
  scores, ``/rerank`` ordered by relevance with ``top_n``.

Bad input on each: a generation request (``/v1/completions``, ``/v1/chat/completions``) to a pooling model, an
embedding request to the cross-encoder, an input over ``--max-model-len``, a dimension outside the Matryoshka
list: HTTP 400 with a message naming the cause, and the server answers a good request the same way afterwards.
(Embedding and score requests to a generative model: ``test_bad_input_http.py``.)
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

import pytest
from npu_testkit import pooling
from npu_testkit.engine import emulated_env
from npu_testkit.serve import vllm_server

pytestmark = pytest.mark.engine

MODEL = "tiny"
TASK = "Given a web search query, retrieve relevant passages that answer the query"
TEXTS = [
    pooling.QWEN3_INSTRUCTION.format(task=TASK, query="What is the capital of the land?"),
    "The capital is a great city by the river.",
    "whale",
    "Call me Ishmael. Some years ago, never mind how long precisely, I thought I would sail about. " * 4,
]
QUERY = "What is the capital of the land?"
DOCS = [
    "The capital is a great city by the river.",
    "Four score and seven years ago our fathers brought forth on this continent a new nation. " * 8,
    "whale",
]
TOO_LONG = "It was the best of times, it was the worst of times. " * 60


def _post(base: str, path: str, body: Any) -> tuple[int, dict]:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _serve(kind: str, tmp_path_factory: Any):
    tmp = tmp_path_factory.mktemp(f"serve_{kind}")
    env = {**os.environ, **emulated_env(tmp, multiprocessing=True)}
    args = [str(pooling.build(kind)), "--runner", "pooling", "--max-model-len", str(pooling.MAX_LEN)]
    args += ["--served-model-name", MODEL, "--dtype", "float32", "--max-num-seqs", "8"]
    return vllm_server(args, env, tmp / "server.log")


def _assert_bad_request(status: int, out: dict, match: str) -> None:
    import re

    assert status == 400, (status, out)
    message = out.get("error", {}).get("message", "") if "error" in out else out.get("message", "")
    assert re.search(match, message), out


# --- the embedder -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    with _serve("qwen3_embed", tmp_path_factory) as base:
        yield base


def _check_embeddings(base: str, texts: list[str], dimensions: int | None = None) -> None:
    import torch

    body: dict[str, Any] = {"model": MODEL, "input": texts}
    if dimensions is not None:
        body["dimensions"] = dimensions
    status, out = _post(base, "/v1/embeddings", body)
    assert status == 200, out
    got = [torch.tensor(d["embedding"]) for d in sorted(out["data"], key=lambda d: d["index"])]
    model_dir = pooling.build("qwen3_embed")
    ref = pooling.hf_embeddings(model_dir, "qwen3_embed", [pooling.text_ids(model_dir, t) for t in texts], dimensions)
    assert [len(g) for g in got] == [len(r) for r in ref]
    cosines = pooling.cosines(got, ref)
    assert min(cosines) >= 0.9999, cosines


def test_embeddings_endpoint_matches_hf(embedder):
    _check_embeddings(embedder, TEXTS)


def test_embeddings_endpoint_matryoshka_dimensions(embedder):
    _check_embeddings(embedder, TEXTS[:3], dimensions=32)


@pytest.mark.parametrize(
    ("path", "body", "match"),
    [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, "does not support Completions API"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            "does not support Chat Completions API",
        ),
        ("/v1/embeddings", {"input": [TOO_LONG]}, f"maximum context length is {pooling.MAX_LEN}"),
        ("/v1/embeddings", {"input": ["hello"], "dimensions": 20}, r"only supports \[16, 32, 64\]"),
    ],
    ids=["completion", "chat", "too-long", "bad-dimensions"],
)
def test_bad_requests_to_the_embedder_are_400(embedder, path, body, match):
    status, out = _post(embedder, path, {"model": MODEL, **body})
    _assert_bad_request(status, out, match)
    _check_embeddings(embedder, TEXTS[1:3])  # unharmed


# --- the cross-encoder --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reranker(embedder, tmp_path_factory):
    # Depends on the embedder's fixture so that the two servers never run at the same time (module order).
    with _serve("xlmr_rerank", tmp_path_factory) as base:
        yield base


def _reference_scores(docs: list[str]) -> list[float]:
    model_dir = pooling.build("xlmr_rerank")
    return pooling.hf_scores(model_dir, "xlmr_rerank", [pooling.pair_ids(model_dir, QUERY, d) for d in docs])


def test_score_endpoint_matches_hf(reranker):
    status, out = _post(reranker, "/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCS})
    assert status == 200, out
    got = [d["score"] for d in sorted(out["data"], key=lambda d: d["index"])]
    assert got == pytest.approx(_reference_scores(DOCS), abs=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_rerank_endpoint_orders_by_hf_scores(reranker, path):
    status, out = _post(reranker, path, {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 2})
    assert status == 200, out
    ref = _reference_scores(DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -ref[i])[:2]
    assert [r["index"] for r in out["results"]] == order
    assert [r["relevance_score"] for r in out["results"]] == pytest.approx([ref[i] for i in order], abs=1e-5)
    assert out["results"][0]["document"]["text"] == DOCS[order[0]]


@pytest.mark.parametrize(
    ("path", "body", "match"),
    [
        ("/v1/embeddings", {"input": ["hello"]}, "does not support Embeddings API"),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, "does not support Completions API"),
        ("/rerank", {"query": QUERY, "documents": [TOO_LONG]}, f"maximum context length is {pooling.MAX_LEN}"),
    ],
    ids=["embeddings", "completion", "too-long"],
)
def test_bad_requests_to_the_reranker_are_400(reranker, path, body, match):
    status, out = _post(reranker, path, {"model": MODEL, **body})
    _assert_bad_request(status, out, match)
    test_score_endpoint_matches_hf(reranker)  # unharmed
