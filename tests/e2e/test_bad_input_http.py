# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Bad input over the HTTP API of ``vllm serve`` (emulated device, tiny bf16 Qwen2): every case gets its clear answer
and the server is unharmed afterwards (a normal greedy request still returns the very tokens it returned first).

One server for the module, bf16 (the dtype whose structured output used to kill the engine: xgrammar's CPU bitmask
takes float32 only), with the testkit's fault-injecting per-request logits processor loaded
(``npu_testkit.faults``): a request carrying ``vllm_xargs={"npu_testkit_fail": ...}`` fails inside its own logits
processing. Structured output on float32 is covered by test_serve.py's server, offline bf16 by test_bf16.py.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from npu_testkit.engine import emulated_env
from npu_testkit.faults import FAIL_KEY
from npu_testkit.serve import vllm_server

pytestmark = pytest.mark.engine

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
HEALTH = {"model": MODEL, "prompt": "It was the best of times", "max_tokens": 8, "temperature": 0.0}
HEALTH.update({"ignore_eos": True, "return_token_ids": True})


def _post(base: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _stream(base: str, path: str, body: dict) -> list[Any]:
    """The server-sent events of a streaming request, parsed (the final ``[DONE]`` as the string)."""
    req = urllib.request.Request(
        base + path, data=json.dumps({**body, "stream": True}).encode(), headers={"Content-Type": "application/json"}
    )
    events: list[Any] = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            text = line.decode().strip()
            if text.startswith("data: "):
                payload = text[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_input_http")
    env = {**os.environ, **emulated_env(tmp, multiprocessing=True)}
    args = [str(tiny_qwen2), "--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "8"]
    args += ["--served-model-name", MODEL, "--logits-processors", "npu_testkit.faults:FailingRequestLogitsProcessor"]
    with vllm_server(args, env, tmp / "server.log") as base:
        status, first = _post(base, "/v1/completions", HEALTH)
        assert status == 200, first
        yield base, first["choices"][0]["token_ids"]


def _assert_unharmed(server: tuple[str, list[int]]) -> None:
    base, reference = server
    status, out = _post(base, "/v1/completions", HEALTH)
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == reference
    assert out["choices"][0]["finish_reason"] == "length"


# --- structured output (valid requests: bf16 logits through xgrammar's CPU bitmask) ------------------------------


def test_completion_json_schema_bf16(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 40, "temperature": 0.0}
    status, out = _post(server[0], "/v1/completions", {**body, "structured_outputs": {"json": SCHEMA}})
    assert status == 200, out
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["text"])["a"], int)
    _assert_unharmed(server)


def test_chat_response_format_json_schema_bf16(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0.0}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    status, out = _post(server[0], "/v1/chat/completions", {**body, "response_format": fmt})
    assert status == 200, out
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"])["a"], int)
    _assert_unharmed(server)


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"regex": "[0-9]{3}"}, lambda text: re.fullmatch("[0-9]{3}", text)),
        ({"choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        ({"grammar": 'root ::= "ab" | "cd"'}, lambda text: text in ("ab", "cd")),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_completion_constraints_bf16(server, constraint, check):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 10, "temperature": 0.0, "structured_outputs": constraint}
    status, out = _post(server[0], "/v1/completions", body)
    assert status == 200, out
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice
    _assert_unharmed(server)


def test_structured_stream_and_plain_requests_together(server):
    # A structured stream next to plain requests in one batch: the bitmask rows land on the right requests.
    plain = {"model": MODEL, "prompt": "hello", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0.0}
    with ThreadPoolExecutor(3) as pool:
        plains = [pool.submit(_post, server[0], "/v1/completions", plain) for _ in range(2)]
        events = _stream(server[0], "/v1/chat/completions", {**body, "response_format": {"type": "json_object"}})
        results = [f.result() for f in plains]
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(text), dict)
    assert all(status == 200 and len(out["choices"][0]["text"]) >= 0 for status, out in results)
    assert all(out["usage"]["completion_tokens"] == 6 for _, out in results)
    _assert_unharmed(server)


# --- one request's logits processing fails: that request ends with an error, the others and later ones complete --


def test_failing_request_ends_with_its_error_and_others_complete(server):
    base = server[0]
    plain = {"model": MODEL, "prompt": "hello", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    failing = {**plain, "vllm_xargs": {FAIL_KEY: "request-b"}}
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_post, base, "/v1/completions", body) for body in (plain, failing, plain)]
        (s1, ok1), (s2, bad), (s3, ok2) = (f.result() for f in futures)
    assert s2 == 200, bad
    (choice,) = bad["choices"]
    assert choice["finish_reason"] == "abort"
    assert choice["stop_reason"] == "logits processor failed: InjectedFault: injected fault for request-b"
    for status, out in ((s1, ok1), (s3, ok2)):
        assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
        assert out["usage"]["completion_tokens"] == 6
    _assert_unharmed(server)


def test_failing_request_in_chat_and_n_gt_1(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2}
    status, out = _post(server[0], "/v1/chat/completions", {**body, "vllm_xargs": {FAIL_KEY: "chat"}})
    assert status == 200, out
    assert [c["finish_reason"] for c in out["choices"]] == ["abort", "abort"]
    assert all("InjectedFault: injected fault for chat" in c["stop_reason"] for c in out["choices"])
    _assert_unharmed(server)


def test_failing_streaming_request_ends_the_stream(server):
    # vLLM's streaming handlers send no chunk for a request that ends before its first token (they skip empty
    # deltas): the stream still ends (no hang), with [DONE].
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "vllm_xargs": {FAIL_KEY: "stream"}}
    events = _stream(server[0], "/v1/completions", body)
    assert events[-1] == "[DONE]"
    assert all(c["finish_reason"] in (None, "abort") for e in events[:-1] for c in e["choices"])
    _assert_unharmed(server)


# --- requests vLLM rejects with a clear 4xx -------------------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 5}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}

REJECTED = [
    ("bad_regex", "/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "[0-9"}}, 400, "invalid regex"),
    ("empty_choice", "/v1/completions", {**COMPLETION, "structured_outputs": {"choice": []}}, 400, "empty list"),
    (
        "bad_grammar",
        "/v1/completions",
        {**COMPLETION, "structured_outputs": {"grammar": "root ::= (("}},
        400,
        "grammar",
    ),
    (
        "bad_schema_type",
        "/v1/completions",
        {**COMPLETION, "structured_outputs": {"json": {"type": "nonsense"}}},
        400,
        "Invalid type: nonsense",
    ),
    ("schema_not_json", "/v1/completions", {**COMPLETION, "structured_outputs": {"json": "{not json"}}, 400, "line 1"),
    (
        "two_constraints",
        "/v1/completions",
        {**COMPLETION, "structured_outputs": {"json": SCHEMA, "regex": "a"}},
        400,
        "only use one kind of constraints",
    ),
    (
        "chat_bad_schema",
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
        400,
        "Invalid type: nonsense",
    ),
    ("prompt_over_max_len", "/v1/completions", {**COMPLETION, "prompt": [5] * 600}, 400, "maximum context length"),
    (
        "prompt_plus_max_tokens",
        "/v1/completions",
        {**COMPLETION, "prompt": [5] * 500, "max_tokens": 100},
        400,
        "maximum context length",
    ),
    ("token_out_of_vocab", "/v1/completions", {**COMPLETION, "prompt": [999999]}, 400, "out of vocabulary"),
    ("empty_prompt", "/v1/completions", {**COMPLETION, "prompt": ""}, 400, "must be provided and non-empty"),
    ("temperature", "/v1/completions", {**COMPLETION, "temperature": -1}, 400, "temperature must be non-negative"),
    ("top_p", "/v1/completions", {**COMPLETION, "top_p": 2}, 400, r"top_p must be in \(0, 1\]"),
    ("top_k", "/v1/completions", {**COMPLETION, "top_k": -5}, 400, "top_k must be 0"),
    ("max_tokens", "/v1/completions", {**COMPLETION, "max_tokens": -1}, 400, "max_tokens must be at least 1"),
    ("n", "/v1/completions", {**COMPLETION, "n": 0}, 400, "n must be at least 1"),
    ("min_tokens", "/v1/completions", {**COMPLETION, "min_tokens": 10}, 400, "min_tokens must be less than"),
    (
        "repetition_penalty",
        "/v1/completions",
        {**COMPLETION, "repetition_penalty": 0},
        400,
        "repetition_penalty must be greater than zero",
    ),
    ("logit_bias_oov", "/v1/completions", {**COMPLETION, "logit_bias": {"999999": 5}}, 400, "out-of-vocab"),
    ("allowed_token_ids_oov", "/v1/completions", {**COMPLETION, "allowed_token_ids": [999999]}, 400, "out-of-vocab"),
    ("seed_not_int", "/v1/completions", {**COMPLETION, "seed": "x"}, 400, "valid integer"),
    ("stop_not_str", "/v1/completions", {**COMPLETION, "stop": 5}, 400, "valid string"),
    (
        "logprobs_over_limit",
        "/v1/completions",
        {**COMPLETION, "logprobs": 1000},
        400,
        "sample logprobs of 1000, which is greater than max allowed: 20",
    ),
    (
        "prompt_logprobs_over_limit",
        "/v1/completions",
        {**COMPLETION, "prompt_logprobs": 1000},
        400,
        "prompt logprobs of 1000, which is greater than max allowed: 20",
    ),
    (
        "chat_top_logprobs_over_limit",
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 1000},
        400,
        "greater than max allowed: 20",
    ),
    ("chat_no_messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "list index out of range"),
    ("unknown_model", "/v1/completions", {**COMPLETION, "model": "nope"}, 404, "The model `nope` does not exist"),
    # pooling requests to a generative model (400 with npu-patches' unsupported-api-status; vLLM 0.11 answered 200)
    ("embeddings", "/v1/embeddings", {"model": MODEL, "input": "hi"}, 400, "does not support Embeddings API"),
    ("score", "/score", {"model": MODEL, "text_1": "a", "text_2": "b"}, 400, "does not support Score API"),
    ("rerank", "/rerank", {"model": MODEL, "query": "a", "documents": ["b"]}, 400, r"does not support Rerank"),
]


@pytest.mark.parametrize(("path", "body", "status", "message"), [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_rejected_with_clear_error(server, path, body, status, message):
    got, out = _post(server[0], path, body)
    assert got == status, out
    assert re.search(message, out["error"]["message"]), out
    _assert_unharmed(server)


def test_malformed_json_body(server):
    status, out = _post(server[0], "/v1/completions", raw=b"{not json")
    assert status == 400 and "JSON decode error" in out["error"]["message"], out
    _assert_unharmed(server)
