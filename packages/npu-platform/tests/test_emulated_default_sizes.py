# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The emulated default's capture sizes (issue 35): ``npu.emulated_compile=inductor`` with no graph setting compiles
sizes 1-16 on every release of the line, not vLLM's default list of dozens (each size is a compile at the first
start). vLLM 0.11.1 dropped the scheduler's ``cuda_graph_sizes`` and computes its default list differently; before
this was read from the installed release, 0.11.1 and 0.11.2 compiled their whole default list (35 sizes at
``max_num_seqs`` 128: a ~20-minute first start).

Runs in the workspace venv (vLLM 0.11.0) and in the compatibility venvs (0.11.1, 0.11.2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from vllm_npu.platform.graphs.config import vllm_default_sizes


def _scheduler_0111(max_seqs: int, max_tokens: int = 8192) -> SimpleNamespace:
    """A vLLM 0.11.1 scheduler config as the size rule reads it: no ``cuda_graph_sizes``."""
    return SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens))


@pytest.mark.parametrize(
    ("max_seqs", "max_tokens", "expected"),
    [
        # VllmConfig._set_cudagraph_sizes of 0.11.1 / 0.11.2: up to min(2 * max_num_seqs, 512, max_num_batched_tokens)
        (128, 8192, [1, 2, 4, *range(8, 257, 8)]),  # the 35 sizes of the first start on 0.11.1
        (256, 8192, [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]),  # 51, multiples of 16 from 256
        (4, 8192, [1, 2, 4, 8]),
        (1, 8192, [1, 2]),
        (256, 100, [1, 2, 4, *range(8, 97, 8)]),  # capped by max_num_batched_tokens
    ],
)
def test_vllm_default_sizes_follow_vllm_0_11_1(max_seqs, max_tokens, expected):
    assert vllm_default_sizes(_scheduler_0111(max_seqs, max_tokens)) == expected  # type: ignore[arg-type]


def test_vllm_default_sizes_of_vllm_0_11_0_are_unchanged():
    scheduler = SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=8192, cuda_graph_sizes=[512])
    assert vllm_default_sizes(SimpleNamespace(scheduler_config=scheduler)) == [1, 2, 4, *range(8, 513, 8)]  # type: ignore[arg-type]
    scheduler.cuda_graph_sizes = [1, 3, 5]  # the user's own list (--cuda-graph-sizes): no default to replace
    assert vllm_default_sizes(SimpleNamespace(scheduler_config=scheduler)) == []  # type: ignore[arg-type]


# Builds the engine config the way vLLM's front end does (EngineArgs.create_engine_config on the emulated device; no
# engine starts) for each case and prints one JSON line: {case: [mode, compile, sizes, max size, padded map]}.
_RESOLVE = """
import json, sys
from vllm.engine.arg_utils import EngineArgs

out = {}
for name, kwargs in json.loads(sys.argv[2]).items():
    cfg = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                     **kwargs).create_engine_config()
    comp = cfg.compilation_config
    largest = getattr(comp, "max_cudagraph_capture_size", None)  # vLLM 0.11.1
    if largest is None:
        largest = comp.max_capture_size  # vLLM 0.11.0
    out[name] = [comp.cudagraph_mode.name, cfg.additional_config["npu"]["emulated_compile"],
                 sorted(comp.cudagraph_capture_sizes), largest, list(comp.bs_to_padded_graph_size)]
print("RESULT " + json.dumps(out))
"""

_INDUCTOR = {"npu": {"emulated_compile": "inductor"}}


def _padded(sizes: list[int]) -> list[int]:
    """The padded batch size of every batch size 0..max(sizes): the smallest capture size at least as large."""
    return [0] + [min(s for s in sizes if s >= bs) for bs in range(1, max(sizes) + 1)]


def test_emulated_compile_alone_captures_1_to_16_on_the_installed_vllm(tmp_path):
    from npu_testkit.engine import emulated_env, tiny_config
    from npu_testkit.models import build_tiny_model

    model = build_tiny_model(tiny_config("qwen2"))
    cases = {
        "seqs128": {"max_num_seqs": 128, "additional_config": _INDUCTOR},  # 0.11.1 compiled 35 sizes here
        "seqs256": {"max_num_seqs": 256, "additional_config": _INDUCTOR},  # vLLM's default max_num_seqs
        "seqs4": {"max_num_seqs": 4, "additional_config": _INDUCTOR},  # no size beyond max_num_seqs
        "users": {"max_num_seqs": 128, "additional_config": _INDUCTOR, "cuda_graph_sizes": [1, 3]},  # kept
    }
    env = {**os.environ, **emulated_env(tmp_path)}
    env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    proc = subprocess.run(
        [sys.executable, "-c", _RESOLVE, str(model), json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    for name, sizes in (("seqs128", [1, 2, 4, 8, 16]), ("seqs256", [1, 2, 4, 8, 16]), ("seqs4", [1, 2, 4])):
        assert result[name] == ["FULL_DECODE_ONLY", "inductor", sizes, max(sizes), _padded(sizes)], name
    assert result["users"] == ["FULL_DECODE_ONLY", "inductor", [1, 3], 3, _padded([1, 3])]
