# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm serve --enable-lora`` on the emulated device with ``--tensor-parallel-size 2`` (one server for the module).

Adapter ``A`` (rank 8: every projection, the token embedding and the LM head) is served from the command line
(``--lora-modules A=<path>``); ``B`` (rank 4, attention only) is loaded and unloaded at run time through
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``). Reference: HF
greedy on the checkpoint with the adapter merged (test_lora_engine.py shows offline generation equals it), so a
completion with ``model=<adapter>`` equals the offline adapter output. TP=2 shards the LoRA B (column-parallel) and
A (row-parallel) weights over two spawned workers with gloo collectives. Prefix caching is on: a prompt's cached
blocks are reused by the same adapter only, never by another adapter or the base model. An adapter whose tensors do
not fit the model is refused with 400 naming the tensor (checked on the full, unsharded sizes, before the TP split).

The refusals run last: vLLM 0.11's MultiprocExecutor stops reading worker replies at the first failed one, so after
a refused load (rank 0 raises, rank 1's identical error stays queued) the next all-worker call (another
``/v1/load_lora_adapter``) reads that stale reply (vllm-project/vllm PR #57846, open). Completions are unaffected
(they take one rank's reply).
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
# 6 full KV blocks of 16 tokens; its seed keeps EOS (token 0 in the generation config) off every greedy path here,
# which hf_greedy forbids (min_new_tokens) and vLLM's ignore_eos does not
LONG = make_prompts([100], seed=21)[0]


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
    refs = {"tiny": hf_greedy(base, [PROMPT, LONG], MAX_TOKENS)}
    for name, path in adapters.items():
        refs[name] = hf_greedy(merge_adapters(base, path, root / name), [PROMPT, LONG], MAX_TOKENS)
    for name in adapters:  # the adapters change the output
        assert refs[name][0] != refs["tiny"][0] and refs[name][1] != refs["tiny"][1], name
    return {(name, i): tokens for name, per_prompt in refs.items() for i, tokens in enumerate(per_prompt)}


@pytest.fixture(scope="module")
def server(base, adapters, references, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    extra = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_SERVER_DEV_MODE": "1",
    }
    env = {**os.environ, **emulated_env(tmp, multiprocessing=True, extra=extra)}
    args = [
        str(base),
        *("--dtype", "float32", "--max-model-len", "512"),
        *("--max-num-seqs", "8", "--served-model-name", "tiny", "--tensor-parallel-size", "2"),
        *("--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--lora-modules", f"A={adapters['A']}"),
        *("--enable-prefix-caching", "--enable-prompt-tokens-details"),
    ]
    with vllm_server(args, env, tmp / "server.log") as url:
        yield url


def _complete(url: str, model: str, prompt: list[int] = PROMPT) -> tuple[int, dict | str]:
    body = {
        "model": model,
        "prompt": prompt,
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


def _tokens_and_cached(url: str, model: str, prompt: list[int]) -> tuple[list[int], int]:
    """Completion tokens and the prompt tokens served from the prefix cache (``--enable-prompt-tokens-details``)."""
    status, out = _complete(url, model, prompt)
    assert status == 200, out
    details = out["usage"].get("prompt_tokens_details") or {}
    return out["choices"][0]["token_ids"], details.get("cached_tokens") or 0


def test_models_lists_the_base_model_and_the_adapter(server):
    with urllib.request.urlopen(f"{server}/v1/models", timeout=30) as resp:
        ids = {m["id"] for m in json.load(resp)["data"]}
    assert ids == {"tiny", "A"}


def test_completion_with_the_adapter_equals_the_merged_reference(server, references):
    assert _tokens(server, "A") == references["A", 0]
    assert _tokens(server, "tiny") == references["tiny", 0]


def test_prefix_cache_is_never_shared_across_adapters(server, adapters, references):
    status, out = _post(f"{server}/v1/load_lora_adapter", {"lora_name": "B", "lora_path": str(adapters["B"])})
    assert status == 200, out
    assert _post(f"{server}/reset_prefix_cache", {})[0] == 200
    # A fills the cache with LONG's blocks; B, the base model and A again see it in that order
    for model, cached in (("A", 0), ("B", 0), ("tiny", 0), ("B", 96), ("A", 96), ("tiny", 96)):
        tokens, got_cached = _tokens_and_cached(server, model, LONG)
        assert tokens == references[model, 1], model
        assert (got_cached >= 96) if cached else (got_cached == 0), (model, got_cached)
    assert _post(f"{server}/v1/unload_lora_adapter", {"lora_name": "B"})[0] == 200


def test_load_and_unload_an_adapter_at_run_time(server, adapters, references):
    status, out = _post(f"{server}/v1/load_lora_adapter", {"lora_name": "B", "lora_path": str(adapters["B"])})
    assert status == 200, out
    assert _tokens(server, "B") == references["B", 0]
    assert _tokens(server, "A") == references["A", 0]
    status, out = _post(f"{server}/v1/unload_lora_adapter", {"lora_name": "B"})
    assert status == 200, out
    status, out = _complete(server, "B")
    assert status == 404 and "B" in json.dumps(out)
    assert _tokens(server, "tiny") == references["tiny", 0]


def test_loading_an_adapter_of_too_high_rank_is_refused_and_the_server_keeps_serving(server, base, tmp_path):
    big = write_peft_adapter(base, tmp_path / "big", targets=ATTENTION, rank=32, seed=3)
    status, out = _post(f"{server}/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(big)})
    assert status == 400 and "LoRA rank 32 is greater than max_lora_rank 16" in json.dumps(out)
    assert _tokens(server, "A") and _complete(server, "big")[0] == 404


def test_an_adapter_whose_tensors_do_not_fit_the_model_is_refused_and_the_server_keeps_serving(
    server, base, references, tmp_path
):
    import torch
    from safetensors.torch import load_file, save_file

    bad = write_peft_adapter(base, tmp_path / "bad", targets=ATTENTION, rank=4, seed=4)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"  # row-parallel: split over the 2 ranks
    tensors[key] = torch.full((4, 32), 0.1)  # half of o_proj's 64 input features: one rank's shard
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    status, out = _post(f"{server}/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    text = json.dumps(out)
    assert status == 400, out
    assert "LoRA adapter 'bad' does not match the base model: model.layers.1.self_attn.o_proj" in text, text
    assert "lora_a is [4, 32], the base model needs [4, 64]" in text, text
    assert _tokens(server, "A") == references["A", 0]
    assert _complete(server, "bad")[0] == 404
