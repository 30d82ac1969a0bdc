# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUCommunicator on two gloo ranks (the emulated device's backend): every collective against plain math."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import _comm_worker  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collectives_on_two_gloo_ranks(tmp_path):
    # spawn, not fork: this pytest process may already have run OpenMP work (fork would deadlock the children).
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_comm_worker.run, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    errors = {f.name: f.read_text() for f in tmp_path.glob("*.err")}
    assert not errors, errors
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert sorted(f.name for f in tmp_path.glob("*.ok")) == ["rank0.ok", "rank1.ok"]
