# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The default start method: a process that ran torch CPU work (an HF reference generate) and then creates ``LLM``
with vLLM's default separate engine-core process and no ``VLLM_WORKER_MULTIPROC_METHOD``. A forked child deadlocks
at model loading (OpenMP state does not survive fork), and on an NPU it cannot re-initialise a runtime the parent
initialised; the platform selects ``spawn``, so this must finish and match HF. The same run checks that the
front-end never initialised the (emulated) device runtime, and profiles the generate under
``VLLM_TORCH_PROFILER_DIR`` (``LLM.start_profile`` / ``stop_profile`` write the worker's CPU trace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from npu_testkit.engine import emulated_env

pytestmark = pytest.mark.engine

SCRIPT = """
import json, os, sys
from npu_testkit.models import hf_greedy
from npu_testkit.engine import make_prompts
model = sys.argv[1]
prompts = make_prompts([7, 33], seed=4)
ref = hf_greedy(model, prompts, 8)           # torch CPU work in this process first
from vllm import LLM, SamplingParams
llm = LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=4, enforce_eager=True)
llm.start_profile()
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
llm.stop_profile()
from vllm_npu.platform._device import EMULATED_RUNTIME
print("RESULT", json.dumps({
    "ref": ref,
    "got": [list(o.outputs[0].token_ids) for o in outs],
    "start_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
    "front_end_runtime_calls": list(EMULATED_RUNTIME.calls),
    "traces": sorted(os.listdir(os.environ["VLLM_TORCH_PROFILER_DIR"])),
}))
"""


@pytest.fixture(scope="module")
def run(tiny_qwen2, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fork_hazard")
    env = {**os.environ, **emulated_env(tmp_path, multiprocessing=True)}
    env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)  # the platform's own choice is under test
    env["VLLM_TORCH_PROFILER_DIR"] = str(tmp_path / "traces")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_qwen2)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_llm_after_hf_work_with_engine_core_process_does_not_hang(run):
    assert run["start_method"] == "spawn"
    assert run["got"] == run["ref"]


def test_the_front_end_never_touched_the_device_runtime(run):
    assert run["front_end_runtime_calls"] == []


def test_start_and_stop_profile_write_the_workers_cpu_trace(run):
    assert [name for name in run["traces"] if name.endswith(".pt.trace.json.gz")], run["traces"]
