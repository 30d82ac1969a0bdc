# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The demo says, before the engine starts, what its default start does (issue 35): on the emulated device the first
start on a machine compiles the decode graphs, so the wait is named with where the result is kept and the way out."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_npu.platform.tools import demo


def test_emulated_notice_names_the_one_time_compile_its_cache_and_the_way_out(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_NPU_DEVICE", "emulated")
    monkeypatch.setenv("VLLM_NPU_CACHE_DIR", str(tmp_path))
    notice = demo._compile_notice()
    assert "first start on a machine compiles them" in notice
    assert str(tmp_path / "emulated_compile") in notice
    assert "--enforce-eager" in notice


def test_npu_notice_does_not_speak_of_the_emulated_compile(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_NPU_DEVICE", "npu")
    assert "compile" not in demo._compile_notice()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], True),
        (["--emulated-compile", "inductor"], True),
        (["--enforce-eager"], False),
        (["--emulated-compile", "none"], False),
        (["--json"], False),
    ],
)
def test_notice_only_when_the_start_may_compile_and_stdout_is_text(flags, expected) -> None:
    assert demo._wants_notice(demo._parser().parse_args(flags)) is expected
