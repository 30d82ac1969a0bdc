# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The fork hazard: a process that ran torch CPU work (an HF reference generate) and then creates ``LLM`` with vLLM's
default separate engine-core process. A forked child deadlocks at model loading (OpenMP state does not survive
fork); the emulated platform selects ``spawn`` so this must finish, and match HF."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from npu_testkit.engine import emulated_env

pytestmark = pytest.mark.engine

SCRIPT = """
import json, sys
from npu_testkit.models import hf_greedy
from npu_testkit.engine import make_prompts
model = sys.argv[1]
prompts = make_prompts([7, 33], seed=4)
ref = hf_greedy(model, prompts, 8)           # torch CPU work in this process first
from vllm import LLM, SamplingParams
llm = LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=4)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print("RESULT", json.dumps({"ref": ref, "got": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def test_llm_after_hf_work_with_engine_core_process_does_not_hang(tiny_qwen2, tmp_path):
    env = {**os.environ, **emulated_env(tmp_path, multiprocessing=True)}
    env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)  # the platform's own choice is under test
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_qwen2)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["got"] == result["ref"]
