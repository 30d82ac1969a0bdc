# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""unsupported-api-status: vLLM's own API routes, for a model without the route's task, answer HTTP 200 with an
error body unpatched, and HTTP 400 with the same body once patched; ``/invocations`` (which reads the error as a
model) still answers 400.

The routes run in a FastAPI app built on vLLM's ``router`` with no serving object for any task, which is what
``init_app_state`` leaves for a task the model lacks (e.g. ``openai_serving_completion = None`` for an embedder).
"""

from __future__ import annotations

import pytest
from vllm_npu.patches import PatchRegistry
from vllm_npu.patches.sets import UNSUPPORTED_API_STATUS

pytestmark = pytest.mark.usefixtures("vllm_unpatched")

REQUESTS = [
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}, "Completions API"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "Chat Completions API"),
    ("/v1/embeddings", {"model": "m", "input": "hi"}, "Embeddings API"),
    ("/score", {"model": "m", "text_1": "a", "text_2": "b"}, "Score API"),
    ("/rerank", {"model": "m", "query": "a", "documents": ["b"]}, "Rerank (Score) API"),
]


@pytest.fixture
def client():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.openai import api_server
    from vllm.entrypoints.openai.serving_engine import OpenAIServing

    class Tokenization:
        log_error_stack = False
        create_error_response = OpenAIServing.create_error_response

    app = FastAPI()
    app.include_router(api_server.router)
    for name in ("completion", "chat", "embedding", "scores", "pooling", "classification"):
        setattr(app.state, f"openai_serving_{name}", None)
    app.state.openai_serving_tokenization = Tokenization()
    return TestClient(app)


def _post(client, path, body):
    resp = client.post(path, json=body)
    return resp.status_code, resp.json()


@pytest.mark.parametrize(("path", "body", "api"), REQUESTS, ids=[r[0] for r in REQUESTS])
def test_unpatched_vllm_answers_200_with_an_error_body(client, path, body, api):
    status, out = _post(client, path, body)
    assert status == 200 and out["error"]["code"] == 400, (status, out)
    assert out["error"]["message"] == f"The model does not support {api}"


@pytest.mark.parametrize(("path", "body", "api"), REQUESTS, ids=[r[0] for r in REQUESTS])
def test_patched_routes_answer_400_with_the_same_body(client, path, body, api):
    reg = PatchRegistry([UNSUPPORTED_API_STATUS])
    reg.apply("platform", environ={})
    try:
        status, out = _post(client, path, body)
        assert status == 400, (status, out)
        assert out["error"] == {
            "message": f"The model does not support {api}",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        # /invocations reads the error as an ErrorResponse (model_dump, error.code): unchanged, still a 400
        status, out = _post(client, "/invocations", {"unknown": 1})
        assert status == 400 and "Cannot find suitable handler" in out["error"]["message"], out
    finally:
        reg.revert()
