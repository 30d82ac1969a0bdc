# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""benchmarks/grammar_bitmask.py still runs against npu-platform's GRAMMAR_BITMASK pair: on small sizes both sides
agree before they are timed, and every row reports what the module docstring says it measures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script_loader import BENCHMARKS, load_script  # noqa: E402

bench = load_script("grammar_bitmask", BENCHMARKS)


def test_runs_every_size_and_dtype(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    assert bench.main(["--repeats", "1", "--batches", "1", "3", "--vocabs", "100", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["vocab"], r["dtype"]) for r in rows] == [
        (b, 100, d) for b in (1, 3) for d in ("float32", "bfloat16")
    ]
    for r in rows:
        assert min(r["host_ms"], r["device_on_cpu_ms"], r["device_dispatch_ms"]) > 0
        assert r["round_trip_bytes"] == 2 * r["batch"] * 100 * 4 and r["device_bytes"] == r["batch"] * 4 * 4
    assert "link MB" in capsys.readouterr().out
