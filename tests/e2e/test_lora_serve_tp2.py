# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm serve --enable-lora`` on the emulated device with ``--tensor-parallel-size 2`` (one server for the module).

Adapter ``A`` (rank 8: every projection, the token embedding and the LM head) is served from the command line
(``--lora-modules A=<path>``); ``B`` (rank 4, attention only) is loaded and unloaded at run time through
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``). Reference: HF
greedy on the checkpoint with the adapter merged (test_lora_engine.py shows offline generation equals it), so a
completion with ``model=<adapter>`` equals the offline adapter output. TP=2 shards the LoRA B (column-parallel) and
A (row-parallel) weights over two spawned workers with gloo collectives.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
from npu_testkit.engine import emulated_env, make_prompts, tiny_config
from npu_testkit.lora import ALL_PROJECTIONS, ATTENTION, merge_adapters, write_peft_adapter
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.serve import vllm_server

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
PROMPT = make_prompts([13], seed=21)[0]


def _post(url: str, body: dict) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as err:
        raw, status = err.read().decode(), err.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


@pytest.fixture(scope="module")
def base():
    return build_tiny_model(tiny_config("llama"))


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "A": write_peft_adapter(
            base, root / "A", targets=(*ALL_PROJECTIONS, "embed_tokens", "lm_head"), rank=8, seed=1
        ),
        "B": write_peft_adapter(base, root / "B", targets=ATTENTION, rank=4, alpha=8, seed=2),
    }


@pytest.fixture(scope="module")
def references(base, adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("merged")
    refs = {"tiny": hf_greedy(base, [PROMPT], MAX_TOKENS)[0]}
    for name, path in adapters.items():
        refs[name] = hf_greedy(merge_adapters(base, path, root / name), [PROMPT], MAX_TOKENS)[0]
    assert refs["A"] != refs["tiny"] and refs["B"] != refs["tiny"]  # the adapters change the output
    return refs


@pytest.fixture(scope="module")
def server(base, adapters, references, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    extra = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    env = {**os.environ, **emulated_env(tmp, multiprocessing=True, extra=extra)}
    args = [
        str(base),
        *("--dtype", "float32", "--max-model-len", "512"),
        *("--max-num-seqs", "8", "--served-model-name", "tiny", "--tensor-parallel-size", "2"),
        *("--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--lora-modules", f"A={adapters['A']}"),
    ]
    with vllm_server(args, env, tmp / "server.log") as url:
        yield url


def _complete(url: str, model: str) -> tuple[int, dict | str]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return _post(f"{url}/v1/completions", body)


def _tokens(url: str, model: str) -> list[int]:
    status, out = _complete(url, model)
    assert status == 200, out
    return out["choices"][0]["token_ids"]


def test_models_lists_the_base_model_and_the_adapter(server):
    with urllib.request.urlopen(f"{server}/v1/models", timeout=30) as resp:
        ids = {m["id"] for m in json.load(resp)["data"]}
    assert ids == {"tiny", "A"}


def test_completion_with_the_adapter_equals_the_merged_reference(server, references):
    assert _tokens(server, "A") == references["A"]
    assert _tokens(server, "tiny") == references["tiny"]


def test_load_and_unload_an_adapter_at_run_time(server, adapters, references):
    status, out = _post(f"{server}/v1/load_lora_adapter", {"lora_name": "B", "lora_path": str(adapters["B"])})
    assert status == 200, out
    assert _tokens(server, "B") == references["B"]
    assert _tokens(server, "A") == references["A"]
    status, out = _post(f"{server}/v1/unload_lora_adapter", {"lora_name": "B"})
    assert status == 200, out
    status, out = _complete(server, "B")
    assert status == 404 and "B" in json.dumps(out)
    assert _tokens(server, "tiny") == references["tiny"]


def test_loading_an_adapter_of_too_high_rank_is_refused_and_the_server_keeps_serving(server, base, tmp_path):
    big = write_peft_adapter(base, tmp_path / "big", targets=ATTENTION, rank=32, seed=3)
    status, out = _post(f"{server}/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    assert status == 400 and "LoRA rank 32 is greater than max_lora_rank 16" in json.dumps(out)
    assert _tokens(server, "A") and _complete(server, "big")[0] == 404
