# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""What the PD disaggregation e2e modules share: HTTP helpers, the KV-usage gauge, and the proxy subprocess."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from npu_testkit.serve import free_port

MAX_TOKENS = 6


def post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {"error": err.read().decode()}


def completion(prompt: list[int], **extra) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def kv_usage(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    (value,) = re.findall(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)
    return float(value)


def wait_usage_zero(url: str, poke, timeout: float = 60) -> float:
    """The instance's KV usage once it is zero (``poke()`` sends it a small request: an idle engine does not step,
    and a prefill engine frees released blocks at its next step)."""
    deadline = time.monotonic() + timeout
    usage = kv_usage(url)
    while usage != 0.0 and time.monotonic() < deadline:
        poke()
        time.sleep(0.5)
        usage = kv_usage(url)
    return usage


@contextlib.contextmanager
def proxy(prefill: list[str], decode: list[str], log: Path):
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
