# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Processes of ``vllm serve`` on the emulated device (the bad-input suite's process surface).

- ``kill -9`` of the API server leaves no process behind: the engine core and its multiprocessing worker exit
  (npu-platform's ``parent_watch``); on an NPU they would otherwise hold device memory.
- SIGTERM while a completion streams: the stream ends with ``finish_reason: "abort"`` and ``data: [DONE]`` and the
  server exits (npu-patches' ``shutdown-ends-requests``); vLLM 0.11 alone leaves the client waiting and the server
  waiting for that connection.

Each test kills its own server, so each starts one (the only engine starts of this module).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.request

import psutil
import pytest
from npu_testkit.engine import emulated_env
from npu_testkit.serve import start_vllm_server

pytestmark = pytest.mark.engine

#: Seconds within which every process of a killed server must be gone (the engine core needs a few; a process that
#: ignores SIGTERM is killed by its watch 10 s after).
EXIT_BOUND_S = 60
#: Seconds a streaming client may wait for its next event after SIGTERM before the test calls the stream hung.
STREAM_BOUND_S = 30
ARGS = ["--dtype", "float32", "--max-model-len", "512", "--served-model-name", "tiny"]


def describe(procs: list[psutil.Process]) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            out.append((p.pid, p.name()))
        except psutil.NoSuchProcess:
            out.append((p.pid, "(gone)"))
    return out


def reap(server: subprocess.Popen[bytes], tree: list[psutil.Process]) -> None:
    """Kill what is left of a server whose test failed (never leave engines running on the test host)."""
    for p in [*tree, psutil.Process(server.pid)] if server.poll() is None else tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    server.wait(timeout=30)


def test_sigkill_of_the_api_server_leaves_no_process(tiny_qwen2, tmp_path) -> None:
    env = {**os.environ, **emulated_env(tmp_path, multiprocessing=True)}
    args = [str(tiny_qwen2), *ARGS, "--distributed-executor-backend", "mp"]  # a worker process, as with TP > 1
    with open(tmp_path / "server.log", "w") as log:
        server, _ = start_vllm_server(args, env, log)
        tree = psutil.Process(server.pid).children(recursive=True)
        try:
            names = [name for _, name in describe(tree)]
            assert any("EngineCore" in n for n in names) and any("Worker" in n for n in names), names
            server.send_signal(signal.SIGKILL)
            server.wait(timeout=30)
            _, alive = psutil.wait_procs(tree, timeout=EXIT_BOUND_S)
            assert not alive, f"{describe(alive)} outlived the API server by {EXIT_BOUND_S} s"
        finally:
            reap(server, tree)
    assert "its parent process" in (tmp_path / "server.log").read_text()


def _events(resp) -> list[str]:
    """The ``data:`` payloads of an SSE stream, read until it ends (each read waits at most the socket timeout)."""
    events = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append(line[len("data: ") :])
            if events[-1] == "[DONE]":
                break
    return events


def test_sigterm_during_a_stream_ends_it_and_the_server_exits(tiny_qwen2, tmp_path) -> None:
    env = {**os.environ, **emulated_env(tmp_path, multiprocessing=True)}
    with open(tmp_path / "server.log", "w") as log:
        server, base = start_vllm_server([str(tiny_qwen2), *ARGS], env, log)
        tree = psutil.Process(server.pid).children(recursive=True)
        try:
            body = {"model": "tiny", "prompt": "It was", "max_tokens": 500, "ignore_eos": True, "stream": True}
            req = urllib.request.Request(
                f"{base}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=STREAM_BOUND_S) as resp:
                first = []
                for raw in resp:  # a few tokens: the request is running in the engine
                    if raw.startswith(b"data: "):
                        first.append(raw)
                    if len(first) == 3:
                        break
                server.send_signal(signal.SIGTERM)
                try:
                    events = _events(resp)
                except TimeoutError:
                    pytest.fail(f"the stream hung: no event within {STREAM_BOUND_S} s after SIGTERM")
            assert events and events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            if "error" not in last:
                assert last["choices"][0]["finish_reason"] == "abort", last
            assert server.wait(timeout=EXIT_BOUND_S) == 0
            _, alive = psutil.wait_procs(tree, timeout=EXIT_BOUND_S)
            assert not alive, f"{describe(alive)} outlived the server"
        finally:
            reap(server, tree)
