# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``parent_watch``: a process with a vLLM engine-process name exits when its parent is SIGKILLed (spawned or
forked, SIGTERM honoured or not); any other child is left alone. The engine-level test (``vllm serve`` killed with
SIGKILL) is tests/e2e/test_process_lifecycle.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

TREE = Path(__file__).with_name("_parent_watch_tree.py")
#: Upper bound for a child to notice its parent's death and exit (grace 1 s in these tests).
EXIT_BOUND_S = 20


def start_tree(method: str, name: str, ignore_term: bool) -> tuple[subprocess.Popen[str], psutil.Process]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen(
        [sys.executable, str(TREE), method, name, "1" if ignore_term else "0"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    return parent, psutil.Process(int(parent.stdout.readline()))


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize("ignore_term", [False, True], ids=["sigterm", "sigkill-after-grace"])
def test_engine_process_exits_when_its_parent_is_killed(method: str, ignore_term: bool) -> None:
    parent, child = start_tree(method, "EngineCore_DP0", ignore_term)
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        child.wait(timeout=EXIT_BOUND_S)  # psutil.TimeoutExpired if it outlives its parent
    finally:
        if child.is_running():
            child.kill()


def test_other_children_are_left_alone() -> None:
    parent, child = start_tree("fork", "Process-1", False)
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        with pytest.raises(psutil.TimeoutExpired):
            child.wait(timeout=3)
    finally:
        child.kill()
