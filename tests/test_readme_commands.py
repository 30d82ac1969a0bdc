# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The README's two set-up commands are the ones CI and users run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", quick)


def test_readme_has_exactly_two_commands_main_job_and_tests() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert demo.startswith("uv run --frozen vllm-npu demo")
    assert tests.startswith("python3 scripts/system_libs.py && uv run --frozen pytest")


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = _readme_commands()[1]
    run_lines = [line for line in ci.splitlines() if "uv run" in line]
    assert run_lines == [test_command]
    assert (ROOT / test_command.split()[1]).is_file(), "the script the README's test command names"
    assert "command -v uv" in ci, ".ci/run must install uv when it is missing"
