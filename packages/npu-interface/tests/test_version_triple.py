# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``vllm-npu doctor``'s check of the installed (vLLM, torch, torch-npu) triple: each problem names the fix."""

from __future__ import annotations

import pytest
from vllm_npu.interface.version_triple import check_triple
from vllm_npu.interface.versions import SUPPORTED_VLLM


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NPU_ALLOW_UNTESTED_VLLM", raising=False)


@pytest.mark.parametrize(
    ("vllm", "torch", "torch_npu"),
    [
        ("0.11.0", "2.8.0", None),  # emulated device, uv.lock's pins
        ("0.11.0+cpu", "2.8.0+cpu", None),
        ("0.11.0", "2.8.0", "2.8.0"),  # Ascend: vLLM built with VLLM_TARGET_DEVICE=empty
        ("0.11.0", "2.8.0", "2.8.0.post2"),
        ("0.11.1", "2.9.0", None),  # 0.11.1 / 0.11.2 with their own PyPI torch, or the Ascend pair
        ("0.11.2", "2.9.0+cu128", None),
        ("0.11.2", "2.8.0", "2.8.0.post2"),
    ],
)
def test_tested_triples_pass(vllm: str, torch: str, torch_npu: str | None) -> None:
    report = check_triple(vllm, torch, torch_npu, SUPPORTED_VLLM)
    assert (report.errors, report.warnings) == ([], [])


def test_a_preview_triple_is_refused_for_the_vllm_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A preview release (none today) with its own torch: only the preview refusal, which names the known gaps."""
    from vllm_npu.interface import vllm_line

    monkeypatch.setattr(vllm_line, "PREVIEW_RELEASES", (vllm_line.Release("0.11.3", torch="2.9.0"),))
    monkeypatch.setattr(vllm_line, "PREVIEW_GAPS", "MoE models diverge from HF")
    (error,) = check_triple("0.11.3", "2.9.0", None, SUPPORTED_VLLM).errors
    assert "is a preview of this line: MoE models diverge from HF" in error


def test_an_untested_vllm_is_an_error_unless_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    (error,) = check_triple("0.12.0", "2.9.0", None, SUPPORTED_VLLM).errors
    assert error.startswith("vLLM 0.12.0 is installed, but this vllm-npu-plugin line is tested on")
    monkeypatch.setenv("VLLM_NPU_ALLOW_UNTESTED_VLLM", "1")
    report = check_triple("0.12.0", "2.9.0", None, SUPPORTED_VLLM)
    assert report.errors == [] and report.warnings == [error]


def test_torch_npu_for_another_torch_names_both_fixes() -> None:
    (error,) = check_triple("0.11.0", "2.9.0", "2.8.0", SUPPORTED_VLLM).errors
    assert error == (
        'torch-npu 2.8.0 is built for torch 2.8.0 but torch 2.9.0 is installed: pip install "torch==2.8.0", or the '
        'tested pair: pip install "npu-platform[ascend]" (torch 2.8.0 + torch-npu 2.8.0)'
    )


def test_an_untested_torch_npu_is_a_warning() -> None:
    report = check_triple("0.11.0", "2.9.0", "2.9.0", SUPPORTED_VLLM)
    assert report.errors == []
    (warning,) = report.warnings
    assert warning.startswith("torch-npu 2.9.0 is untested: the NPU calls are checked against torch-npu 2.8.0")
    assert 'pip install "npu-platform[ascend]"' in warning


def test_the_pypi_wheel_torch_pin_is_a_warning_without_torch_npu() -> None:
    (warning,) = check_triple("0.11.2", "2.8.0", None, SUPPORTED_VLLM).warnings
    assert warning.startswith("vLLM 0.11.2's PyPI wheel is built for torch 2.9.0 but torch 2.8.0 is installed")
