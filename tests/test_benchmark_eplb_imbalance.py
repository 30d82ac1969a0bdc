# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""benchmarks/eplb_imbalance.py still runs against npu-ops and vLLM's rebalancer (small sizes), and rebalancing a
skewed load really lowers the counted max/mean load per rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script_loader import BENCHMARKS, load_script  # noqa: E402

bench = load_script("eplb_imbalance", BENCHMARKS)


def test_rebalancing_lowers_the_imbalance(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    argv = ["--experts", "8", "--redundant", "2", "--ranks", "2", "--tokens", "64", "--steps", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["before"] > res["after"] >= 1.0
    assert sorted(set(res["rebalanced_map"])) == list(range(8)) and res["rebalanced_map"] != res["initial_map"]
    assert "after rebalancing" in capsys.readouterr().out
