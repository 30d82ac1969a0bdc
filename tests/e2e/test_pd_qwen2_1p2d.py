# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Prefill-decode disaggregation on the emulated device, everything on 127.0.0.1: one prefill instance
(``kv_producer``), two decode instances (``kv_consumer``), a second prefill instance with tensor parallelism 2, npu-kv's MooncakeConnector over Mooncake TCP between them,
and ``vllm-npu pd-proxy`` in front (least-loaded). Tiny Qwen2 (GQA), float32, block size 16.

One set of instances for the module (three ``vllm serve`` and the proxy). A request through the proxy with one
decode instance busy is 1P1D; 32 concurrent requests spread over both decode instances are 1P2D; a second proxy
puts the TP=2 prefill instance in front of a TP=1 decode instance (the GQA head split). References: HF
float32 greedy, and a decode instance's own greedy for the same request without remote prefill (single instance).
The decode side computed only the last prompt token (``prompt_tokens_details.cached_tokens``), and the prefill
side's KV usage returns to zero. Faults: a decode request pointing at a prefill side that does not exist, and a
prefill instance that cannot be reached through the proxy, both complete with the right tokens (the decode instance
computes the prompt); blocks nobody pulls are freed at the timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from npu_testkit.engine import emulated_env, make_prompts
from npu_testkit.models import hf_greedy
from npu_testkit.serve import free_port, vllm_server
from npu_testkit.sibling import import_sibling
from npu_testkit.system_libs import require_mooncake_libraries

pd = import_sibling(__file__, "pd_support")

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
#: Prompt lengths: within one block, on a block boundary, over several blocks (block size 16).
LENGTHS = [3, 16, 17, 45, 130]
ABORT_TIMEOUT_S = 15


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=7)


@pytest.fixture(scope="module")
def references(tiny_qwen2, prompts) -> list[list[int]]:
    return hf_greedy(tiny_qwen2, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(tiny_qwen2, tmp_path_factory):
    require_mooncake_libraries()  # the Mooncake engine's system libraries, or the apt line that installs them
    tmp = tmp_path_factory.mktemp("pd")
    common = [str(tiny_qwen2), "--dtype", "float32", "--max-model-len", "512", "--block-size", "16"]
    common += ["--max-num-seqs", "16", "--served-model-name", "tiny", "--enable-prompt-tokens-details"]
    kv_port = free_port()
    producer = {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_producer",
        "kv_port": kv_port,
        "kv_connector_extra_config": {"abort_timeout_s": ABORT_TIMEOUT_S},
    }
    consumer = {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"handshake_timeout_s": 3},
    }
    producer_tp2 = {**producer, "kv_port": free_port(2)}
    instances = [
        ("prefill", producer, []),
        ("decode0", consumer, []),
        ("decode1", consumer, []),
        ("prefill_tp2", producer_tp2, ["--tensor-parallel-size", "2"]),
    ]
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, cfg, more in instances:
            extra = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"} if more else None
            env = {**os.environ, **emulated_env(tmp / name, multiprocessing=True, extra=extra)}
            args = [*common, *more, "--kv-transfer-config", json.dumps(cfg)]
            urls[name] = stack.enter_context(vllm_server(args, env, tmp / f"{name}.log"))
        urls["proxy"] = stack.enter_context(
            pd.proxy([urls["prefill"]], [urls["decode0"], urls["decode1"]], tmp / "proxy.log")
        )
        urls["proxy_tp2"] = stack.enter_context(pd.proxy([urls["prefill_tp2"]], [urls["decode0"]], tmp / "proxy2.log"))
        urls["kv_port"] = str(kv_port)
        urls["logs"] = str(tmp)
        yield urls


def test_single_requests_through_the_proxy_equal_hf_and_compute_only_after_the_prompt(cluster, prompts, references):
    for prompt, want in zip(prompts, references):
        status, out = pd.post(f"{cluster['proxy']}/v1/completions", pd.completion(prompt))
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want, len(prompt)
        # The decode side took all but the last prompt token from the prefill side's KV.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        # A decode instance on its own (no remote prefill) gives the same answer: the single-instance greedy.
        status, alone = pd.post(f"{cluster['decode0']}/v1/completions", pd.completion(prompt))
        assert status == 200 and alone["choices"][0]["token_ids"] == want


def test_chat_streaming_and_not(cluster):
    messages = [{"role": "user", "content": "It was the best of times, it was the worst of times"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    status, direct = pd.post(f"{cluster['decode1']}/v1/chat/completions", body)
    assert status == 200
    status, proxied = pd.post(f"{cluster['proxy']}/v1/chat/completions", body)
    assert status == 200, proxied
    assert proxied["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert proxied["usage"]["prompt_tokens_details"]["cached_tokens"] == proxied["usage"]["prompt_tokens"] - 1

    req = urllib.request.Request(
        f"{cluster['proxy']}/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    pieces = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
    assert "".join(pieces) == direct["choices"][0]["message"]["content"]


def test_streaming_completion(cluster, prompts, references):
    req = urllib.request.Request(
        f"{cluster['proxy']}/v1/completions",
        data=json.dumps(pd.completion(prompts[3], stream=True)).encode(),
        headers={"Content-Type": "application/json"},
    )
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
    assert tokens == references[3]


def test_1p2d_32_concurrent_requests(cluster, tiny_qwen2):
    prompts = make_prompts([5 + 7 * i for i in range(32)], seed=11)
    references = hf_greedy(tiny_qwen2, prompts, MAX_TOKENS)
    with urllib.request.urlopen(f"{cluster['proxy']}/health", timeout=30) as resp:
        before = json.load(resp)["decode"]["served"]
    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(lambda p: pd.post(f"{cluster['proxy']}/v1/completions", pd.completion(p)), prompts))
    for (status, out), want in zip(results, references):
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want
    with urllib.request.urlopen(f"{cluster['proxy']}/health", timeout=30) as resp:
        after = json.load(resp)["decode"]
    assert after["in_flight"] == dict.fromkeys(after["in_flight"], 0)
    served = {u: after["served"][u] - before[u] for u in before}
    assert sum(served.values()) == 32 and min(served.values()) > 0, served  # both decode instances took requests


def test_prefill_tp2_to_decode_tp1(cluster, prompts, references):
    """Prefill with TP=2 (each rank holds one of the two KV heads), decode with TP=1: the decode rank pulls from both
    prefill ranks and puts each rank's head in its place."""
    for prompt, want in zip(prompts, references):
        status, out = pd.post(f"{cluster['proxy_tp2']}/v1/completions", pd.completion(prompt))
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want, len(prompt)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1

    def poke() -> None:
        pd.post(f"{cluster['prefill_tp2']}/v1/completions", pd.completion(prompts[0], max_tokens=1))

    assert pd.wait_usage_zero(cluster["prefill_tp2"], poke, timeout=ABORT_TIMEOUT_S / 2) == 0.0
    assert "no decode instance pulled its KV" not in (Path(cluster["logs"]) / "prefill_tp2.log").read_text()


def test_prefill_kv_usage_returns_to_zero(cluster, prompts):
    def poke() -> None:
        pd.post(f"{cluster['prefill']}/v1/completions", pd.completion(prompts[0], max_tokens=1))

    assert pd.wait_usage_zero(cluster["prefill"], poke, timeout=ABORT_TIMEOUT_S / 2) == 0.0
    # Every proxied request was released by its decode instance, none by the timeout.
    assert "no decode instance pulled its KV" not in (Path(cluster["logs"]) / "prefill.log").read_text()
    for name in ("decode0", "decode1"):
        assert pd.kv_usage(cluster[name]) == 0.0


def test_decode_recomputes_when_the_prefill_side_is_gone(cluster, prompts, references):
    """kv_transfer_params pointing at a prefill side that does not exist: the pull fails, the decode instance
    computes the prompt itself (PDScheduler), the answer is right and no block is left behind."""
    dead = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(range(9)),
        "remote_engine_id": "gone",
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "tp_size": 1,
    }
    status, out = pd.post(f"{cluster['decode0']}/v1/completions", pd.completion(prompts[4], kv_transfer_params=dead))
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == references[4]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] < len(prompts[4]) - 1
    assert "its prompt is recomputed here" in (Path(cluster["logs"]) / "decode0.log").read_text()
    assert pd.kv_usage(cluster["decode0"]) == 0.0


def test_held_blocks_are_freed_at_the_timeout(cluster, prompts, references):
    """Blocks the prefill instance holds for a decode side that never says ``done`` are freed after abort_timeout_s
    (one wait for the three holds): a request whose decode side never comes; a decode worker that handshakes, reads
    half of a request's blocks over Mooncake and is killed (SIGKILL); a request through the proxy whose decode
    instance is unreachable (a clear 502 naming it, never tokens). The prefill instance keeps serving right answers."""
    log = Path(cluster["logs"]) / "prefill.log"
    expired_before = log.read_text().count("no decode instance pulled its KV")

    # 1. Nobody pulls.
    status, out = pd.post(
        f"{cluster['prefill']}/v1/completions",
        pd.completion(prompts[4], max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
    )
    assert status == 200, out
    params = out["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_port"] == int(cluster["kv_port"])
    assert len(params["remote_block_ids"]) == -(-len(prompts[4]) // 16)
    assert pd.kv_usage(cluster["prefill"]) > 0.0  # held for the decode side

    # 2. A decode worker dies mid-transfer: half the blocks read, no "done".
    status, out = pd.post(
        f"{cluster['prefill']}/v1/completions",
        pd.completion(prompts[3], max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
    )
    assert status == 200, out
    params = out["kv_transfer_params"]
    worker = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("pd_dying_decode.py")),
            params["remote_host"],
            str(params["remote_port"]),
            json.dumps(params["remote_block_ids"]),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline()
        assert line.startswith("partial "), line
    finally:
        worker.kill()
        worker.wait(timeout=30)

    # 3. Through the proxy: the prefill instance holds the KV, the decode instance is gone.
    with pd.proxy([cluster["prefill"]], [f"http://127.0.0.1:{free_port()}"], Path(cluster["logs"]) / "proxy3.log") as p:
        status, out = pd.post(f"{p}/v1/completions", pd.completion(prompts[2]))
    assert status == 502 and "decode instance http://127.0.0.1:" in out["error"] and "unreachable" in out["error"]
    assert pd.kv_usage(cluster["prefill"]) > 0.0  # all three still held
    assert log.read_text().count("no decode instance pulled its KV") == expired_before

    time.sleep(ABORT_TIMEOUT_S + 1)

    def poke() -> None:
        pd.post(f"{cluster['prefill']}/v1/completions", pd.completion(prompts[0], max_tokens=1))

    assert pd.wait_usage_zero(cluster["prefill"], poke) == 0.0
    assert log.read_text().count("no decode instance pulled its KV") == expired_before + 3
    # The prefill instance (and its Mooncake engine, whose peer died mid-read) still serves right answers.
    status, out = pd.post(f"{cluster['proxy']}/v1/completions", pd.completion(prompts[4]))
    assert status == 200 and out["choices"][0]["token_ids"] == references[4]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompts[4]) - 1
