# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu selftest`` as a user runs it on this host: every kernel row, the runtime section (front-end and fork
rule, graph tasks, sleep with graphs, a torchair restart with another KV size: real engines on the emulated
device), then the end-to-end generate compared with HF transformers' greedy decoding of the same built-in model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from npu_testkit.demo import seed_demo_model
from npu_testkit.engine import emulated_env

pytestmark = pytest.mark.engine


RUNTIME_CHECKS = (
    "front-end",
    "fork rule",
    "graph task (gqa)",
    "graph task (mla)",
    "sleep with graphs",
    "torchair restart",
)


def test_selftest_runs_kernels_runtime_and_end_to_end_on_the_emulated_device(tmp_path) -> None:
    env = {**os.environ, **emulated_env(tmp_path)}
    seed_demo_model(env["VLLM_NPU_CACHE_DIR"])  # trained once per machine (npu_testkit/demo.py)
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_npu.platform.tools.cli", "selftest", "--json", "--max-tokens", "6"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["summary"]["fail"] == 0 and report["summary"]["pass"] > 100
    runtime = {row["check"]: row for row in report["runtime"]}
    assert tuple(runtime) == RUNTIME_CHECKS
    assert all(row["status"] == "pass" for row in runtime.values()), runtime
    assert "start method: spawn" in runtime["front-end"]["detail"]
    assert "forked subprocess" in runtime["fork rule"]["detail"]
    assert "the update changed the result" in runtime["graph task (mla)"]["detail"]
    assert "the restart compiled into a new one" in runtime["torchair restart"]["detail"]
    e2e = report["e2e"]
    assert e2e["ok"] and e2e["mismatches"] == [] and e2e["dtype"] == "float32"
    (worker,) = e2e["device"]["workers"]
    assert worker["device_mode"] == "emulated" and worker["kernel_backend"] == "reference"
    assert e2e["baseline"]["kernels"].startswith("hf-transformers")
    assert all(len(ids) == 6 for ids in e2e["device"]["token_ids"])
    # the built-in model continues the passages it was trained on
    assert e2e["device"]["texts"][0].startswith(" our fathers")
