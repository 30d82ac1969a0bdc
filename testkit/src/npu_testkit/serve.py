# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm serve`` as a subprocess of a test module: started on a free 127.0.0.1 port, polled until
``/v1/models`` answers, stopped with SIGINT (then killed) when the block ends (:func:`vllm_server`), or handed to a
test that stops it itself (:func:`start_vllm_server`)."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import pytest

#: Seconds a server may take to answer ``/v1/models`` (a cold start on a loaded 2-core host is slow).
STARTUP_TIMEOUT_S = 900


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log_path: Path) -> str:
    return log_path.read_text()[-4000:]


def pin_eager_args(args: Sequence[str]) -> list[str]:
    """``vllm serve`` arguments with ``--enforce-eager`` added unless they choose the graph mode themselves
    (``--enforce-eager``, ``--compilation-config`` / ``-O``, or an ``--additional-config`` naming ``graph_mode`` or
    ``emulated_compile``): the emulated device's default compiles and captures, which serving tests do not need."""
    flags = ("--enforce-eager", "--compilation-config", "-O")
    chooses = any(a.startswith(flags) for a in args)
    chooses = chooses or any(key in a for a in args for key in ('"graph_mode"', '"emulated_compile"'))
    return list(args) if chooses else [*args, "--enforce-eager"]


def start_vllm_server(
    args: Sequence[str], env: Mapping[str, str], log: IO[str], *, timeout_s: float = STARTUP_TIMEOUT_S
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``vllm serve <args> --host 127.0.0.1 --port <free port>`` (the venv's ``vllm`` script, ``env`` as its
    whole environment, stdout and stderr into ``log``) and return the process and its base URL
    ``http://127.0.0.1:<port>`` once ``/v1/models`` returns 200; eager unless ``args`` choose a graph mode
    (:func:`pin_eager_args`). Fails the test, with the end of the log (and the
    server killed), if the server exits or is not ready within ``timeout_s`` seconds. The caller stops the server."""
    port = free_port()
    args = pin_eager_args(args)
    cmd = [str(Path(sys.executable).with_name("vllm")), "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, env=dict(env), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{_log_tail(Path(log.name))}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return proc, base
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=30)
            pytest.fail(f"vllm serve not ready after {timeout_s}s:\n{_log_tail(Path(log.name))}")
        time.sleep(1)


@contextlib.contextmanager
def vllm_server(
    args: Sequence[str], env: Mapping[str, str], log_path: Path, *, timeout_s: float = STARTUP_TIMEOUT_S
) -> Iterator[str]:
    """Run ``vllm serve <args> --host 127.0.0.1 --port <free port>`` (see :func:`start_vllm_server`; the log goes to
    ``log_path``) and yield its base URL ``http://127.0.0.1:<port>`` once ``/v1/models`` returns 200; stop it with
    SIGINT (then SIGKILL) when the block ends."""
    with open(log_path, "w") as log:
        proc, base = start_vllm_server(args, env, log, timeout_s=timeout_s)
        try:
            yield base
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
