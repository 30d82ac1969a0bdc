# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""scripts/suite_times.py on small records of a ``-n 2 --dist loadfile`` run: the terminal output with
``--durations=0`` and a JUnit XML file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests._script_loader import load_script

times = load_script("suite_times")

DURATIONS = """\
============================= test session starts ==============================
created: 2/2 workers
2 workers [6 items]
..I1204 22:46:39.998238  2792 transfer_metadata.cpp:616] removeSegmentDesc 127.0.0.1:16677 finish
....
============================= slowest durations ================================
76.02s setup    tests/e2e/test_pd_qwen2_1p2d.py::test_single_requests[a b]
40.00s call     tests/e2e/test_selftest.py::test_cli_selftest_kernel_rows
30.50s call     tests/e2e/test_pd_qwen2_1p2d.py::test_single_requests[a b]
12.00s setup    tests/e2e/test_selftest.py::test_cli_selftest_kernel_rows
3.25s teardown tests/e2e/test_pd_qwen2_1p2d.py::test_concurrent
2.00s call     packages/npu-kv/tests/test_transfer.py::test_handshake
1.00s call     packages/npu-kv/tests/test_layout.py::test_head_sources
0.01s call     tests/test_docs_tree.py::test_x

(4 durations < 0.005s hidden.  Use -vv to show these durations.)
=================== 7 passed, 1 failed, 2 warnings in 1178.20s (0:19:38) ===================
"""

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" errors="0"
failures="0" skipped="0" tests="3" time="95.5"><testcase classname="packages.npu-kv.tests.test_transfer"
name="test_handshake" time="2.5" /><testcase classname="tests.e2e.test_demo.TestDemo" name="test_runs[x]"
time="49.0" /><testcase classname="tests.e2e.test_demo.TestDemo" name="test_again" time="1.0" /></testsuite>
</testsuites>"""


def test_durations_per_module_and_top() -> None:
    run = times.parse(DURATIONS)
    assert run.wall == pytest.approx(1178.20)
    assert run.count == 8
    assert run.partial is None
    assert run.total("tests/e2e/test_pd_qwen2_1p2d.py::test_single_requests[a b]") == pytest.approx(106.52)
    text, ok = times.report(run, top=2)
    assert ok
    lines = text.splitlines()
    assert (
        lines[0]
        == "6 tests with times (the run reports 8) in 5 modules; test time summed over the workers: 2 min 44.8 s"
    )
    assert "session wall time: 19 min 38.2 s" in lines
    module_rows = lines[lines.index("per module (5 of 5):") + 2 :][:5]
    assert [row.split()[-1] for row in module_rows] == [
        "tests/e2e/test_pd_qwen2_1p2d.py",
        "tests/e2e/test_selftest.py",
        "packages/npu-kv/tests/test_transfer.py",
        "packages/npu-kv/tests/test_layout.py",
        "tests/test_docs_tree.py",
    ]
    assert module_rows[0].split()[:3] == ["109.8", "66.6%", "2"]
    folder_rows = lines[lines.index("per folder:") + 2 :][:3]
    assert [row.split()[-1] for row in folder_rows] == ["tests/e2e", "packages/npu-kv", "tests"]
    top = lines[lines.index("top 2 tests:") + 2 :]
    assert len(top) == 2
    assert top[0].split()[:4] == ["106.5", "76.0", "30.5", "0.0"]
    assert top[0].endswith("tests/e2e/test_pd_qwen2_1p2d.py::test_single_requests[a b]")
    assert top[1].endswith("tests/e2e/test_selftest.py::test_cli_selftest_kernel_rows")


def test_a_partial_durations_list_says_so() -> None:
    run = times.parse(DURATIONS.replace("slowest durations ====", "slowest 15 durations ===="))
    assert "--durations=15" in (run.partial or "")
    assert "NOTE: the run listed only its 15 slowest phases" in times.report(run)[0]


def test_budget() -> None:
    run = times.parse(DURATIONS)
    text, ok = times.report(run, budget_min=25)
    assert ok and "budget 25 min: 5 min 21.8 s left" in text
    text, ok = times.report(run, budget_min=19)
    assert not ok and "budget 19 min: 0 min 38.2 s OVER" in text


def test_junit_modules_from_classnames(tmp_path: Path) -> None:
    run = times.parse(JUNIT)
    assert run.wall == 95.5 and run.count == 3
    assert run.total("tests/e2e/test_demo.py::test_runs[x]") == 49.0
    assert run.total("packages/npu-kv/tests/test_transfer.py::test_handshake") == 2.5
    # With the checkout at hand the longest prefix that is a file wins (a lower-case class name stays right).
    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    (tmp_path / "tests" / "e2e" / "test_demo.py").write_text("")
    lower = JUNIT.replace("test_demo.TestDemo", "test_demo.lower_case_group")
    assert "tests/e2e/test_demo.py::test_again" in times.parse(lower, tmp_path).tests


def test_main_exit_codes(tmp_path: Path, capsys) -> None:
    record = tmp_path / "run.log"
    record.write_text(DURATIONS)
    assert times.main([str(record), "--budget-min", "25", "--modules", "1"]) == 0
    out = capsys.readouterr().out
    assert "per module (1 of 5):" in out
    assert times.main([str(record), "--budget-min", "10"]) == 1
    record.write_text("no durations here\n")
    assert times.main([str(record)]) == 2
    assert "no test times" in capsys.readouterr().err


def test_ci_run_reports_the_times_and_keeps_pytests_verdict(tmp_path: Path) -> None:
    """.ci/run with stand-ins for uv (a "suite" that writes a JUnit record and fails) and for the system-library
    step: the time report follows the run, pytest's closing line comes last again, and the exit status is pytest's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_uv = bin_dir / "uv"
    fake_uv.write_text(
        "#!/usr/bin/env bash\n"
        '[ "$1" = --version ] && { echo "uv 0.0.0 (stand-in)"; exit 0; }\n'
        'xml="${PYTEST_ADDOPTS##*--junitxml=}"\n'
        'printf \'%s\' \'<testsuites><testsuite tests="1" time="61"><testcase classname="tests.e2e.test_demo" '
        'name="test_demo" time="49" /></testsuite></testsuites>\' > "$xml"\n'
        'echo "=========== 1 failed in 61.00s ==========="\n'
        "exit 3\n"
    )
    fake_python = bin_dir / "python3"
    fake_python.write_text(
        "#!/usr/bin/env bash\n"
        '[ "$1" = scripts/system_libs.py ] && { echo "system libraries: (stand-in)"; exit 0; }\n'
        f'exec {sys.executable} "$@"\n'
    )
    for f in (fake_uv, fake_python):
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp_path), "PYTEST_ADDOPTS": ""}
    ci_run = Path(str(times.__file__)).resolve().parents[1] / ".ci" / "run"
    done = subprocess.run(
        ["bash", str(ci_run)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert "1 tests with times in 1 modules" in done.stdout
    assert "budget 25 min: 23 min 59.0 s left" in done.stdout
    assert "tests/e2e/test_demo.py::test_demo" in done.stdout
    # pytest's closing line is repeated after the report: CI reads a run's verdict from its last lines
    assert done.stdout.rstrip().splitlines()[-1] == "=========== 1 failed in 61.00s ==========="
