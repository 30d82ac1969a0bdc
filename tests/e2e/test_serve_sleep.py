# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm serve --enable-sleep-mode`` on the emulated device with static graphs, through the dev-mode endpoints
(``VLLM_SERVER_DEV_MODE=1``: ``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/collective_rpc``), with vLLM's default
start method (no ``VLLM_WORKER_MULTIPROC_METHOD`` in the environment).

One server per graph mode (PIECEWISE, FULL_DECODE_ONLY), each through sleep level 1, then level 2 (weights reloaded
from the checkpoint), each followed by a full wake-up: greedy completions after wake-up equal HF transformers' and
the server's own before sleep, and every graph was captured again after wake-up (wake-up gives the weights and KV
caches new device addresses; graphs captured before would read the old ones) and replayed.
"""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any

import pytest
from npu_testkit.engine import emulated_env, make_prompts
from npu_testkit.models import hf_greedy
from npu_testkit.serve import vllm_server

pytestmark = pytest.mark.engine

MAX_TOKENS = 10
CAPTURE_SIZES = [1, 2, 4]
#: Graphs per capture size: 2 decoder layers -> 3 PIECEWISE pieces; 1 FULL graph of the whole model.
GRAPHS_PER_SIZE = {"PIECEWISE": 3, "FULL_DECODE_ONLY": 1}
RUNTIME_MODE = {"PIECEWISE": "PIECEWISE", "FULL_DECODE_ONLY": "FULL"}


def _request(url: str, body: dict | None = None, method: str = "POST") -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


@pytest.fixture(scope="module", params=sorted(GRAPHS_PER_SIZE))
def server(request, tiny_qwen2, tmp_path_factory):
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"serve-sleep-{mode.lower()}")
    env = {**os.environ, **emulated_env(tmp, multiprocessing=True), "VLLM_SERVER_DEV_MODE": "1"}
    env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)  # vLLM's default start method
    compilation = {"cudagraph_mode": mode, "cudagraph_capture_sizes": CAPTURE_SIZES}
    args = [str(tiny_qwen2), "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8"]
    args += ["--served-model-name", "tiny", "--enable-sleep-mode", "--compilation-config", json.dumps(compilation)]
    with vllm_server(args, env, tmp / "server.log") as base:
        yield mode, base


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts([5, 11, 17], seed=41)  # a decode batch of 3, padded to the size-4 graph


@pytest.fixture(scope="module")
def expected(tiny_qwen2, prompts) -> list[list[int]]:
    return hf_greedy(tiny_qwen2, prompts, MAX_TOKENS)


def _complete(base: str, prompts: list[list[int]]) -> list[list[int]]:
    body = {"model": "tiny", "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    out = _request(f"{base}/v1/completions", {**body, "return_token_ids": True})
    return [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]


def _info(base: str) -> dict[str, Any]:
    (info,) = _request(f"{base}/collective_rpc", {"method": "npu_runtime_info"})["results"]
    return info


def _sleeping(base: str) -> bool:
    return _request(f"{base}/is_sleeping", method="GET")["is_sleeping"]


def test_greedy_before_sleep_matches_hf_through_graphs(server, prompts, expected):
    mode, base = server
    assert _complete(base, prompts) == expected
    info = _info(base)
    assert info["cudagraph_mode"] == mode and info["capture_sizes"] == CAPTURE_SIZES
    captured = GRAPHS_PER_SIZE[mode] * len(CAPTURE_SIZES)
    assert info["graphs"]["captures"] == {RUNTIME_MODE[mode]: captured}
    assert info["graphs"]["replays"][RUNTIME_MODE[mode]] > 0


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_recaptures_every_graph_and_keeps_greedy_output(server, prompts, expected, level):
    mode, base = server
    runtime = RUNTIME_MODE[mode]
    before = _info(base)["graphs"]
    assert _complete(base, prompts) == expected
    _request(f"{base}/sleep?level={level}")
    assert _sleeping(base)
    asleep = _info(base)
    assert asleep["sleeping_bytes"]["weights"] > 100_000 and asleep["sleeping_bytes"]["kv_cache"] > 1_000_000, asleep
    _request(f"{base}/wake_up")
    assert not _sleeping(base)
    awake = _info(base)["graphs"]
    # Every graph captured again after wake-up, over the live weights and KV caches.
    captured = GRAPHS_PER_SIZE[mode] * len(CAPTURE_SIZES)
    assert awake["captures"][runtime] == before["captures"][runtime] + captured, (before, awake)
    assert _complete(base, prompts) == expected  # == HF == before sleep
    assert _info(base)["graphs"]["replays"][runtime] > awake["replays"][runtime]
