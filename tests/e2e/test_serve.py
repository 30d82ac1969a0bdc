# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm serve`` on the emulated device (127.0.0.1): completions and chat completions return the greedy tokens of
offline generation. Offline generation equals HF transformers token for token (test_qwen2_engine.py), so HF greedy
on the very prompt ids the server reports is the reference here, which keeps this module to one engine."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from npu_testkit.engine import emulated_env, make_prompts
from npu_testkit.models import hf_greedy

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
STARTUP_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    port = _free_port()
    env = {**os.environ, **emulated_env(tmp, multiprocessing=True)}
    vllm_bin = Path(sys.executable).with_name("vllm")
    with open(tmp / "server.log", "w") as log:
        yield from _run_server(tiny_qwen2, tmp, port, env, vllm_bin, log)


def _run_server(tiny_qwen2, tmp, port, env, vllm_bin, log):
    proc = subprocess.Popen(
        [
            str(vllm_bin),
            "serve",
            str(tiny_qwen2),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "8",
            "--served-model-name",
            "tiny",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{(tmp / 'server.log').read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"vllm serve not ready after {STARTUP_TIMEOUT_S}s:\n{(tmp / 'server.log').read_text()[-4000:]}"
                )
            time.sleep(1)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


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
