# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""What the in-process engine benchmarks (``graph_replay.py``, ``torchair_compile.py``) share: their command line,
the tiny Qwen2 they serve, the time per decode step and the JSON dump. Each runs as a script, so this folder is on
``sys.path``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def parse_args(doc: str) -> argparse.Namespace:
    """``--tokens`` (decode steps measured, 32), ``--repeats`` (best of, 3), ``--layers`` (of the tiny Qwen2, 2),
    ``--json`` (results file, none by default); ``doc`` is the script's docstring (its first line describes it)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json")
    return ap.parse_args()


def tiny_qwen2(layers: int) -> Path:
    """Directory of a tiny float32 Qwen2 checkpoint (hidden 64) with ``layers`` decoder layers."""
    from npu_testkit.engine import tiny_config
    from npu_testkit.models import build_tiny_model

    return build_tiny_model(tiny_config("qwen2", num_hidden_layers=layers))


def step_ms(llm: Any, prompts: list[list[int]], tokens: int, repeats: int) -> float:
    """Host time of one decode step in ms: ``(t(generate 1 + tokens) - t(generate 1)) / tokens``, best of
    ``repeats`` after one warm-up, so prefill and request setup cancel out."""
    from vllm import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    run(1 + tokens)  # warm-up
    best = min(run(1 + tokens) - run(1) for _ in range(repeats))
    return 1000.0 * best / tokens


def write_json(path: str | None, results: dict[str, Any]) -> None:
    """Write ``results`` to ``path`` (indented JSON) when a path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
