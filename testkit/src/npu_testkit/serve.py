# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm serve`` as a subprocess of a test module: started on a free 127.0.0.1 port, polled until
``/v1/models`` answers, stopped with SIGINT (then killed) when the block ends (:func:`vllm_server`), or handed to a
test that stops it itself (:func:`start_vllm_server`)."""

from __future__ import annotations

import contextlib
import random
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


def _ephemeral_start() -> int:
    """The first port of Linux's ephemeral range (``ip_local_port_range``; 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


#: Where :func:`free_port` picks: below the ephemeral range, so no ``connect()`` or ``bind(port 0)`` on the host (the
#: servers' ZMQ and Mooncake sockets, vLLM's own ``get_open_port``) can take a port between the pick and the bind of
#: the process it was picked for -- seconds later, after a server's imports. A port handed out by the kernel was
#: taken that way in the suite ("Address already in use" for a second prefill instance's kv_port).
_PICK_FROM = 20000

#: Draws from the OS, never from ``random``'s global generator: tests seed that one (``random.seed``), and two xdist
#: workers seeded alike drew the same "free" port for two servers starting at the same time.
_DRAWS = random.SystemRandom()


def free_port(block: int = 1) -> int:
    """The first of ``block`` consecutive TCP ports on 127.0.0.1 that were free a moment ago, drawn at random below the
    ephemeral range (see ``_PICK_FROM``); only another explicit bind can take them before their process binds."""
    stop = _ephemeral_start() - block
    if stop <= _PICK_FROM:
        raise RuntimeError(f"no room for {block} ports below the ephemeral range (starts at {stop + block})")
    for _ in range(200):
        base = _DRAWS.randrange(_PICK_FROM, stop)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + block):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {block} free consecutive ports in {_PICK_FROM}-{stop + block - 1} on 127.0.0.1")


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


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` or one of its descendants holds a listening TCP socket on ``port``: the answer on a
    port is this server's, not another test's server that took the same port first (this one then fails to bind
    and exits, which the caller sees next)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return False


def start_vllm_server(
    args: Sequence[str], env: Mapping[str, str], log: IO[str], *, timeout_s: float = STARTUP_TIMEOUT_S
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``vllm serve <args> --host 127.0.0.1 --port <free port>`` (the venv's ``vllm`` script, ``env`` as its
    whole environment, stdout and stderr into ``log``) and return the process and its base URL
    ``http://127.0.0.1:<port>`` once ``/v1/models`` returns 200 from it (its own listening socket, :func:`listens_on`);
    eager unless ``args`` choose a graph mode
    (:func:`pin_eager_args`). Fails the test, with the end of the log (and the
    server killed), if the server exits or is not ready within ``timeout_s`` seconds. The caller stops the server."""
    if "vllm" in sys.modules and "VLLM_CACHE_ROOT" in env and args and Path(args[0]).is_dir():
        # The server's front end finds vLLM's model-class inspection cached (model_info.py) instead of starting a
        # subprocess for it; only where this process has vLLM imported already (a test process of engine modules).
        from .engine import patched_environ
        from .model_info import warm_model_info

        with patched_environ({"VLLM_CACHE_ROOT": env["VLLM_CACHE_ROOT"]}):
            warm_model_info(args[0])
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
                if resp.status == 200 and listens_on(proc.pid, port):
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
