# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Prefill-decode disaggregation on the emulated device, everything on 127.0.0.1: one prefill instance
(``kv_producer``), two decode instances (``kv_consumer``), npu-kv's MooncakeConnector over Mooncake TCP between them,
and ``vllm-npu pd-proxy`` in front (least-loaded). Tiny Qwen2 (GQA), float32, block size 16.

One set of instances for the module (three ``vllm serve`` and the proxy). A request through the proxy with one
decode instance busy is 1P1D; 32 concurrent requests spread over both decode instances are 1P2D. References: HF
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
import re
import socket
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

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
#: Prompt lengths: within one block, on a block boundary, over several blocks (block size 16).
LENGTHS = [3, 16, 17, 45, 130]
ABORT_TIMEOUT_S = 8


def _post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {"error": err.read().decode()}


def _completion(prompt: list[int], **extra) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def _kv_usage(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    (value,) = re.findall(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)
    return float(value)


def _wait_usage_zero(url: str, poke, timeout: float = 60) -> float:
    """The instance's KV usage once it is zero (``poke()`` sends it a small request: an idle engine does not step,
    and a prefill engine frees released blocks at its next step)."""
    deadline = time.monotonic() + timeout
    usage = _kv_usage(url)
    while usage != 0.0 and time.monotonic() < deadline:
        poke()
        time.sleep(0.5)
        usage = _kv_usage(url)
    return usage


def _port_block(n: int) -> int:
    for _ in range(50):
        base = free_port()
        if base + n >= 65536:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for i in range(n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port block")


@contextlib.contextmanager
def _proxy(prefill: list[str], decode: list[str], log: Path):
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("vllm-npu")), "pd-proxy", "--prefill", *prefill, "--decode", *decode]
    cmd += ["--port", str(port), "--policy", "least_loaded"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log.read_text()
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5):
                        break
                except (urllib.error.URLError, ConnectionError):
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.3)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LENGTHS, seed=7)


@pytest.fixture(scope="module")
def references(tiny_qwen2, prompts) -> list[list[int]]:
    return hf_greedy(tiny_qwen2, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(tiny_qwen2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    common = [str(tiny_qwen2), "--dtype", "float32", "--max-model-len", "512", "--block-size", "16"]
    common += ["--max-num-seqs", "16", "--served-model-name", "tiny", "--enable-prompt-tokens-details"]
    kv_port = _port_block(1)
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
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, cfg in (("prefill", producer), ("decode0", consumer), ("decode1", consumer)):
            env = {**os.environ, **emulated_env(tmp / name, multiprocessing=True)}
            args = [*common, "--kv-transfer-config", json.dumps(cfg)]
            urls[name] = stack.enter_context(vllm_server(args, env, tmp / f"{name}.log"))
        urls["proxy"] = stack.enter_context(
            _proxy([urls["prefill"]], [urls["decode0"], urls["decode1"]], tmp / "proxy.log")
        )
        urls["kv_port"] = str(kv_port)
        urls["logs"] = str(tmp)
        yield urls


def test_single_requests_through_the_proxy_equal_hf_and_compute_only_after_the_prompt(cluster, prompts, references):
    for prompt, want in zip(prompts, references):
        status, out = _post(f"{cluster['proxy']}/v1/completions", _completion(prompt))
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want, len(prompt)
        # The decode side took all but the last prompt token from the prefill side's KV.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        # A decode instance on its own (no remote prefill) gives the same answer: the single-instance greedy.
        status, alone = _post(f"{cluster['decode0']}/v1/completions", _completion(prompt))
        assert status == 200 and alone["choices"][0]["token_ids"] == want


def test_chat_streaming_and_not(cluster):
    messages = [{"role": "user", "content": "It was the best of times, it was the worst of times"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    status, direct = _post(f"{cluster['decode1']}/v1/chat/completions", body)
    assert status == 200
    status, proxied = _post(f"{cluster['proxy']}/v1/chat/completions", body)
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
        data=json.dumps(_completion(prompts[3], stream=True)).encode(),
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
        results = list(pool.map(lambda p: _post(f"{cluster['proxy']}/v1/completions", _completion(p)), prompts))
    for (status, out), want in zip(results, references):
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want
    with urllib.request.urlopen(f"{cluster['proxy']}/health", timeout=30) as resp:
        after = json.load(resp)["decode"]
    assert after["in_flight"] == dict.fromkeys(after["in_flight"], 0)
    served = {u: after["served"][u] - before[u] for u in before}
    assert sum(served.values()) == 32 and min(served.values()) > 0, served  # both decode instances took requests


def test_prefill_kv_usage_returns_to_zero(cluster, prompts):
    def poke() -> None:
        _post(f"{cluster['prefill']}/v1/completions", _completion(prompts[0], max_tokens=1))

    assert _wait_usage_zero(cluster["prefill"], poke) == 0.0
    for name in ("decode0", "decode1"):
        assert _kv_usage(cluster[name]) == 0.0


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
    status, out = _post(f"{cluster['decode0']}/v1/completions", _completion(prompts[4], kv_transfer_params=dead))
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == references[4]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] < len(prompts[4]) - 1
    assert "its prompt is recomputed here" in (Path(cluster["logs"]) / "decode0.log").read_text()
    assert _kv_usage(cluster["decode0"]) == 0.0


def test_unpulled_blocks_are_freed_at_the_timeout(cluster, prompts):
    """A prefill request whose decode side never comes: its blocks are held, then freed after abort_timeout_s."""
    status, out = _post(
        f"{cluster['prefill']}/v1/completions",
        _completion(prompts[4], max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
    )
    assert status == 200, out
    params = out["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_port"] == int(cluster["kv_port"])
    assert len(params["remote_block_ids"]) == -(-len(prompts[4]) // 16)
    assert _kv_usage(cluster["prefill"]) > 0.0  # held for the decode side
    time.sleep(ABORT_TIMEOUT_S + 1)

    def poke() -> None:
        _post(f"{cluster['prefill']}/v1/completions", _completion(prompts[0], max_tokens=1))

    assert _wait_usage_zero(cluster["prefill"], poke) == 0.0
    assert "no decode instance pulled its KV" in (Path(cluster["logs"]) / "prefill.log").read_text()
