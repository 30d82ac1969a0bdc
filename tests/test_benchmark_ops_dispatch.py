# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""benchmarks/ops_dispatch_overhead.py still runs against the ops layer (it reaches into layer internals), and its
pooled statistic is the one documented: the median of per-round ratios over every process's rounds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script_loader import BENCHMARKS, load_script  # noqa: E402

bench = load_script("ops_dispatch_overhead", BENCHMARKS)


def test_runs_every_case_in_process(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    argv = ["--processes", "1", "--repeats", "3", "--number", "2", "--tokens", "1", "3", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["op"], r["tokens"]) for r in rows} == {
        (op, t) for op in ("add+rms_norm", "rms_norm", "silu_and_mul", "quick_gelu", "rope (cache hit)") for t in (1, 3)
    }
    for r in rows:
        assert min(r["kernel_us"], r["forward_oot_us"], r["module_us"]) > 0
    assert "worst forward_oot overhead" in capsys.readouterr().out


def test_pools_the_rounds_of_every_process(tmp_path, monkeypatch, capsys) -> None:
    """Two fake children: the overhead is the median over all six rounds, the times the minimum over all."""
    children = iter(
        [
            {"rope (cache hit)|1": [[10.0, 10.0, 10.2, 12.0], [11.0, 11.0, 11.1, 13.0], [10.0, 10.1, 10.9, 12.0]]},
            {"rope (cache hit)|1": [[9.0, 9.0, 9.9, 11.0], [10.0, 10.0, 10.3, 12.0], [10.0, 9.9, 10.4, 12.0]]},
        ]
    )
    seen = []

    def fake_run(cmd, check, stdout):  # noqa: ANN001
        seen.append(cmd)
        Path(cmd[cmd.index("--raw-json") + 1]).write_text(json.dumps(next(children)))

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    out = tmp_path / "r.json"
    assert bench.main(["--processes", "2", "--ops", "rope", "--tokens", "1", "--json", str(out)]) == 0
    assert len(seen) == 2 and all(c[c.index("--processes") + 1] == "1" and "--json" not in c for c in seen)
    (row,) = json.loads(out.read_text())["rows"]
    # per-round oot ratios: 1.02, 1.009, 1.09, 1.1, 1.03, 1.04 -> median 1.035
    assert row["oot_overhead_pct"] == pytest.approx(3.5, abs=0.05)
    assert row["kernel_us"] == 9.0 and row["forward_oot_us"] == 9.9 and row["module_us"] == 11.0
