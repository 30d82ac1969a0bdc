# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""benchmarks/vs_vllm_cpu.py without the peer: both sides' children are faked, so what is checked is the driver
itself (pinning, the flags each side gets, the per-pair wall and CPU ratios and their medians), not any speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script_loader import BENCHMARKS, load_script  # noqa: E402

bench = load_script("vs_vllm_cpu", BENCHMARKS)


def test_pairs_alternate_pinned_with_wall_and_cpu_ratios(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ours: 100 tok/s at 2 CPU-ms/token; the peer: 200 tok/s at 4 CPU-ms/token (wall ratio 0.5, CPU ratio 2.0),
    # except one noisy pair that must not move the medians.
    results = iter(
        [
            {"side": "ours", "tokens_per_s": 100.0, "cpu_s_per_token": 0.002, "init_s": 5.0, "init_cpu_s": 4.0},
            {"side": "peer", "tokens_per_s": 200.0, "cpu_s_per_token": 0.004, "init_s": 10.0, "init_cpu_s": 9.0},
        ]
        * 2
        + [
            {"side": "ours", "tokens_per_s": 10.0, "cpu_s_per_token": 0.02, "init_s": 50.0, "init_cpu_s": 4.0},
            {"side": "peer", "tokens_per_s": 200.0, "cpu_s_per_token": 0.004, "init_s": 10.0, "init_cpu_s": 9.0},
        ]
    )
    commands: list[list[str]] = []

    def fake_run(cmd: list[str], env: dict[str, str], capture_output: bool, text: bool) -> subprocess.CompletedProcess:
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="log line\n" + json.dumps(next(results)) + "\n", stderr="")

    monkeypatch.setattr(bench, "ensure_peer", lambda venv: Path("/peer/bin/python"))
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    out = tmp_path / "r.json"
    bench.main(["--pairs", "3", "--cpus", "0", "--ours-graph", "full_decode_only", "--json", str(out)])

    assert [c[:3] for c in commands] == [["taskset", "-c", "0"]] * 6
    sides = [c[c.index("--side") + 1] for c in commands]
    assert sides == ["ours", "peer"] * 3
    assert commands[1][3] == "/peer/bin/python" and "--eager" not in commands[1]  # the peer compiles by default
    assert "--additional-config" in commands[0] and "--eager" not in commands[0]
    report = json.loads(out.read_text())
    assert [round(p["ratio"], 3) for p in report["pairs"]] == [0.5, 0.5, 0.05]
    assert [round(p["cpu_ratio"], 3) for p in report["pairs"]] == [2.0, 2.0, 0.2]
    assert report["median"] == pytest.approx(0.5) and report["cpu_median"] == pytest.approx(2.0)
