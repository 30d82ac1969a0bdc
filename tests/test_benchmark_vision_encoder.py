# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""benchmarks/vision_encoder.py still runs against npu-models' vision overrides: on a tiny shape, every architecture's
override tower (padded and unpadded) equals vLLM's before it is timed, and the rows report what was measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script_loader import BENCHMARKS, load_script  # noqa: E402

bench = load_script("vision_encoder", BENCHMARKS)


def test_runs_every_architecture_on_a_tiny_tower(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    argv = ["--depth", "1", "--heads", "2", "--size", "64", "--images", "2", "--repeats", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["arch"], r["padded_to_128"]) for r in rows] == [
        ("qwen2_vl", True),
        ("qwen2_5_vl", True),
        ("qwen3_vl", False),
    ]
    for r in rows:
        assert min(r["vllm_eager_ms_per_image"], r["override_reference_ms_per_image"], r["ratio"]) > 0
    assert "per image" in capsys.readouterr().out
