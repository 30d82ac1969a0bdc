# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm serve`` on the emulated device (127.0.0.1): completions and chat completions return the greedy tokens of
offline generation. Offline generation equals HF transformers token for token (test_qwen2_engine.py), so HF greedy
on the very prompt ids the server reports is the reference here, which keeps this module to one engine."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
from npu_testkit.engine import emulated_env, make_prompts
from npu_testkit.models import hf_greedy
from npu_testkit.serve import vllm_server

pytestmark = pytest.mark.engine

MAX_TOKENS = 12


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    env = {**os.environ, **emulated_env(tmp, multiprocessing=True)}
    args = [str(tiny_qwen2), "--dtype", "float32", "--max-model-len", "512"]
    with vllm_server([*args, "--max-num-seqs", "8", "--served-model-name", "tiny"], env, tmp / "server.log") as base:
        yield base


def test_completion_matches_offline_greedy(server, tiny_qwen2):
    prompt = make_prompts([17], seed=31)[0]
    out = _post(
        f"{server}/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    (choice,) = out["choices"]
    assert choice["token_ids"] == hf_greedy(tiny_qwen2, [prompt], MAX_TOKENS)[0]


def test_chat_completion_matches_offline_greedy(server, tiny_qwen2):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "It was the best of times"}]
    out = _post(
        f"{server}/v1/chat/completions",
        {
            "model": "tiny",
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    prompt_ids = out["prompt_token_ids"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    assert prompt_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    (choice,) = out["choices"]
    assert choice["token_ids"] == hf_greedy(tiny_qwen2, [prompt_ids], MAX_TOKENS)[0]


def test_image_for_a_text_only_model_is_vllms_error_and_the_server_keeps_serving(server, tiny_qwen2):
    import base64
    import io
    import urllib.error

    from npu_testkit.vl_models import synthetic_image

    buf = io.BytesIO()
    synthetic_image(56, 56).save(buf, format="PNG")
    uri = f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(f"{server}/v1/chat/completions", body)
    assert err.value.code == 400
    message = json.load(err.value)["error"]["message"]
    assert f"{tiny_qwen2} is not a multimodal model" in message, message
    # The server keeps serving.
    out = _post(f"{server}/v1/completions", {"model": "tiny", "prompt": "It was", "max_tokens": 2})
    assert len(out["choices"]) == 1


def test_chat_json_schema_float32_and_the_server_keeps_serving(server, tiny_qwen2):
    # Structured output on float32 logits (xgrammar's own CPU path); bf16 is test_bad_input_http.py's server.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0.0}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    (choice,) = _post(f"{server}/v1/chat/completions", {**body, "response_format": fmt})["choices"]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"])["a"], int)
    prompt = make_prompts([9], seed=5)[0]
    plain = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    (out,) = _post(f"{server}/v1/completions", {**plain, "return_token_ids": True})["choices"]
    assert out["token_ids"] == hf_greedy(tiny_qwen2, [prompt], 4)[0]


def _structured_body(case, prompt: list[int], style: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0.0, "return_token_ids": True}
    if style == "structured_outputs":
        return {**body, "structured_outputs": case.params}
    # vLLM 0.11's deprecated request fields, still accepted and forwarded to structured_outputs
    ((kind, value),) = case.params.items()
    return {**body, f"guided_{kind}": value}


@pytest.mark.parametrize("style", ["structured_outputs", "guided"])
@pytest.mark.parametrize("index", range(1, 5), ids=["regex", "choice", "grammar_ebnf", "grammar_lark"])
def test_structured_completion_float32_equals_the_constrained_greedy_reference(server, tiny_qwen2, index, style):
    from npu_testkit.structured import CASES, hf_structured_greedy, structured_prompts, without_stop

    case, prompt = CASES[index], structured_prompts()[index]
    (choice,) = _post(f"{server}/v1/completions", _structured_body(case, prompt, style))["choices"]
    assert choice["finish_reason"] == "stop" and case.valid(choice["text"]), choice
    want = hf_structured_greedy(tiny_qwen2, prompt, case.params)
    assert without_stop(tiny_qwen2, choice["token_ids"]) == without_stop(tiny_qwen2, want)
