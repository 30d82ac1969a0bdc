# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The testkit's engines run eagerly unless a test chooses a graph mode (issue 35: the emulated device's default
compiles and captures, which the suite's engines that do not test graphs would pay at every start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from npu_testkit.engine import pin_eager
from npu_testkit.serve import pin_eager_args


def test_llm_kwargs_without_a_graph_choice_are_pinned_eager():
    assert pin_eager({"dtype": "float32"}) == {"dtype": "float32", "enforce_eager": True}
    assert pin_eager({"additional_config": {"npu": {"kernels": "reference"}}})["enforce_eager"] is True


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enforce_eager": False},
        {"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
        {"additional_config": {"npu": {"graph_mode": "torchair"}}},
        {"additional_config": {"npu": {"emulated_compile": "inductor"}}},
    ],
)
def test_llm_kwargs_that_choose_the_graph_mode_are_kept(kwargs):
    assert pin_eager(kwargs) == kwargs


def test_serve_args_are_pinned_eager_unless_they_choose():
    assert pin_eager_args(["m", "--dtype", "float32"]) == ["m", "--dtype", "float32", "--enforce-eager"]
    for chosen in (
        ["m", "--enforce-eager"],
        ["m", "--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'],
        ["m", "-O3"],
        ["m", "--additional-config", '{"npu": {"graph_mode": "piecewise"}}'],
    ):
        assert pin_eager_args(chosen) == chosen


# Resolves each case's engine config on the emulated device, the way vLLM's front end does (no engine starts), and
# prints one JSON line: {case: [cudagraph_mode, npu.emulated_compile in effect, capture sizes]}.
_RESOLVE = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from npu_testkit.engine import pin_eager

out = {}
for name, model, pinned in json.loads(sys.argv[1]):
    kwargs = {"model": model, "skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 256}
    cfg = EngineArgs(**(pin_eager(kwargs) if pinned else kwargs)).create_engine_config()
    compiled = (cfg.additional_config or {}).get("npu", {}).get("emulated_compile")
    sizes = sorted(cfg.compilation_config.cudagraph_capture_sizes or [])
    out[name] = [cfg.compilation_config.cudagraph_mode.name, compiled, sizes]
print("RESULT " + json.dumps(out))
"""


def test_the_emulated_default_compiles_and_the_testkit_pin_keeps_test_engines_eager(tmp_path: Path) -> None:
    # issue 35: vLLM's default (nothing set) is compiled FULL_DECODE_ONLY graphs on the emulated device; a test
    # engine built through the testkit (make_llm / start_vllm_server) stays eager unless it chooses a graph mode.
    from npu_testkit.engine import emulated_env, tiny_config

    model = tmp_path / "model"
    tiny_config("qwen2", architectures=["Qwen2ForCausalLM"]).save_pretrained(model)
    cases = [["default", str(model), False], ["pinned", str(model), True]]
    env = {**os.environ, **emulated_env(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["default"] == ["FULL_DECODE_ONLY", "inductor", [1, 2, 4, 8, 16]]
    assert result["pinned"] == ["NONE", "none", []]
