# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu demo`` (the README's main job) runs real vLLM through the whole plugin stack on the emulated device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from npu_testkit.demo import seed_demo_model
from npu_testkit.engine import emulated_env

pytestmark = pytest.mark.engine


def test_demo_generates_language_and_reports_our_components(tmp_path) -> None:
    env = {**os.environ, **emulated_env(tmp_path, multiprocessing=True)}
    seed_demo_model(env["VLLM_NPU_CACHE_DIR"])  # trained once per machine (npu_testkit/demo.py)
    proc = subprocess.run(
        # Eager: this test is about the stack, not compilation (the default compiles each capture size first).
        [
            sys.executable,
            "-m",
            "vllm_npu.platform.tools.cli",
            "demo",
            "--json",
            "--max-tokens",
            "12",
            "--enforce-eager",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    completions = {c["prompt"]: c["completion"] for c in result["completions"]}
    # The embedded model was trained on the bundled passages: it continues them.
    assert completions["Four score and seven years ago"].startswith(" our fathers brought forth")
    assert completions["Call me Ishmael."].startswith(" Some years ago")
    assert result["generated_tokens"] == 12 * len(completions)
    assert result["tokens_per_second"] > 0
    assert result["graph_mode"] == "eager (no graphs)"  # the demo reports which mode ran
    (worker,) = result["workers"]
    assert worker["platform"] == "vllm_npu.platform.platform.EmulatedNPUPlatform"
    assert worker["worker"] == "vllm_npu.platform.worker.NPUWorker"
    assert worker["model_runner"] == "vllm_npu.platform.model_runner.NPUModelRunner"
    assert worker["attention_backends"] == ["vllm_npu.attention.backends.gqa.AscendAttentionBackend"]
    assert worker["kernel_backend"] == "reference"
    assert {"NPURMSNorm", "NPUSiluAndMul", "NPURotaryEmbedding"} <= set(worker["plugin_modules"])
