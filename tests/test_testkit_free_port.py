# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu_testkit.serve.free_port``: ports for servers started seconds later are drawn below the kernel's ephemeral
range, where no outgoing connection or ``bind(port 0)`` can take them in between (a second prefill instance once
found its kv_port taken that way)."""

from __future__ import annotations

import random
import socket
import subprocess
import sys

import pytest
from npu_testkit import serve


def test_ports_are_free_and_below_the_ephemeral_range() -> None:
    start = serve._ephemeral_start()
    for block in (1, 2, 4):
        base = serve.free_port(block)
        assert base >= serve._PICK_FROM and base + block <= start
        for port in range(base, base + block):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_seeding_the_global_generator_does_not_repeat_the_draws() -> None:
    """Two pytest workers that seed ``random`` alike (tests do) must not draw the same port for two servers."""
    draws = []
    for _ in range(2):
        random.seed(1234)
        draws.append([serve.free_port() for _ in range(5)])
    assert draws[0] != draws[1]


def test_a_block_holding_a_taken_port_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken - 1, *range(taken + 1, taken + 40, 3)])  # first: a block of two ending on the taken port
        monkeypatch.setattr(serve, "_PICK_FROM", taken - 2)
        monkeypatch.setattr(serve, "_ephemeral_start", lambda: taken + 50)
        monkeypatch.setattr(serve._DRAWS, "randrange", lambda lo, hi: next(draws))
        assert serve.free_port(2) > taken


_LISTENER = """
import socket, sys, time
with socket.socket() as s:
    s.bind(("127.0.0.1", int(sys.argv[1])))
    s.listen()
    print("listening", flush=True)
    time.sleep(60)
"""


def test_a_server_is_ready_only_on_its_own_listening_socket() -> None:
    """``start_vllm_server`` takes a 200 on its port as its server's only when that server (or a child of it)
    holds the listening socket: two servers once drew one port, and the second one's readiness poll got the
    first one's answer."""
    port = serve.free_port()
    owner = subprocess.Popen([sys.executable, "-c", _LISTENER, str(port)], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "listening"
        assert serve.listens_on(owner.pid, port)
        assert not serve.listens_on(other.pid, port)  # the server that lost the port: alive, listening nowhere
        assert not serve.listens_on(owner.pid, port + 1)
    finally:
        for p in (owner, other):
            p.kill()
            p.wait(timeout=30)
    assert not serve.listens_on(owner.pid, port)  # gone
