# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm serve --data-parallel-size 2`` on the emulated device, one server per case: two DP engine cores started by
vLLM's engine manager with its DP coordinator, the API server's load balancer spreading requests over both.

- ``moe-ep``: tiny Qwen3-MoE with ``--enable-expert-parallel``, EP=2 over the two ranks (3 of the 6 experts each);
- ``dense``: tiny Qwen2, each DP engine a full replica (no collective between the ranks in the forward).

Six completions sent at once; each equals HF transformers greedy for its prompt, and vLLM's per-engine metrics show
that both DP engines finished requests (for MoE: the layers really exchanged tokens between two stepping ranks, with
dummy batches on the rank that runs out of requests first). The offline cases: test_data_parallel_offline.py.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from npu_testkit.engine import emulated_env, make_prompts, tiny_config
from npu_testkit.models import build_tiny_model, hf_greedy
from npu_testkit.serve import vllm_server

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
PROMPTS = make_prompts([5, 9, 17, 3, 11, 7], seed=3)


#: case -> (tiny model kind, extra server arguments)
CASES = {"moe-ep": ("qwen3_moe", ("--enable-expert-parallel",)), "dense": ("qwen2", ())}


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(case):
    return build_tiny_model(tiny_config(CASES[case][0]))


@pytest.fixture(scope="module")
def reference(model):
    return hf_greedy(model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def server(case, model, reference, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"serve-dp-{case}")
    env = {**os.environ, **emulated_env(tmp, multiprocessing=True, extra={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"})}
    args = [
        str(model),
        *("--dtype", "float32", "--max-model-len", "512", "--served-model-name", "tiny"),
        *("--data-parallel-size", "2", *CASES[case][1], "--max-num-batched-tokens", "64"),
    ]
    with vllm_server(args, env, tmp / "server.log") as url:
        yield url


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)["choices"][0]["token_ids"]


def test_concurrent_completions_equal_hf_and_both_dp_engines_serve(server, reference):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _complete(server, p), PROMPTS))
    assert got == reference
    with urllib.request.urlopen(f"{server}/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    per_engine: dict[str, float] = {}
    for line in re.finditer(r"^vllm:request_success_total\{([^}]*)\} (\S+)$", metrics, re.M):
        engine = re.search(r'engine="(\d+)"', line.group(1))
        if engine:
            per_engine[engine.group(1)] = per_engine.get(engine.group(1), 0.0) + float(line.group(2))
    assert set(per_engine) == {"0", "1"} and all(n > 0 for n in per_engine.values()), per_engine
    assert sum(per_engine.values()) == len(PROMPTS)
