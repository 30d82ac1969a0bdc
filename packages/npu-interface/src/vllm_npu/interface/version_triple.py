# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The installed (vLLM, torch, torch-npu) triple against the tested releases (:mod:`.vllm_line`): what
``vllm-npu doctor`` reports, each problem with the command that fixes it. Reads versions only (no imports)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .vllm_line import TESTED_RELEASES, allow_untested, release, untested_vllm


def _base(version: str) -> str:
    """``2.8.0.post2`` / ``2.8.0+cpu`` / ``2.8.0rc1`` -> ``2.8.0`` (torch-npu's post releases pair with torch X.Y.Z)."""
    from packaging.version import Version

    return Version(version).base_version


@dataclass
class TripleReport:
    """``errors`` make doctor fail; ``warnings`` are an untested but possibly working combination."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_triple(vllm: str | None, torch: str | None, torch_npu: str | None, supported: str) -> TripleReport:
    """Check the installed triple (None = not installed; vLLM's absence is reported elsewhere)."""
    report = TripleReport()
    refusal = untested_vllm(vllm, supported)
    if refusal is not None:
        (report.warnings if allow_untested() else report.errors).append(refusal)
    tested = release(vllm) if vllm is not None else None
    ascend = TESTED_RELEASES[0]  # the Ascend pair is the same for every release of the line
    if torch is not None and torch_npu not in (None, "unknown"):
        assert torch_npu is not None
        if _base(torch) != _base(torch_npu):
            report.errors.append(
                f"torch-npu {torch_npu} is built for torch {_base(torch_npu)} but torch {torch} is installed: "
                f'pip install "torch=={_base(torch_npu)}", or the tested pair: pip install "npu-platform[ascend]" '
                f"(torch {ascend.ascend_torch} + torch-npu {ascend.torch_npu})"
            )
        elif _base(torch_npu) != ascend.torch_npu:
            report.warnings.append(
                f"torch-npu {torch_npu} is untested: the NPU calls are checked against torch-npu {ascend.torch_npu}'s "
                f'documented signatures; the tested pair: pip install "npu-platform[ascend]" (torch '
                f"{ascend.ascend_torch} + torch-npu {ascend.torch_npu}, with vLLM built with VLLM_TARGET_DEVICE=empty)"
            )
    elif torch is not None and tested is not None and _base(torch) != tested.torch:
        # No torch-npu (emulated device on a CPU/CUDA host): PyPI's vLLM wheel is built for one torch.
        report.warnings.append(
            f"vLLM {vllm}'s PyPI wheel is built for torch {tested.torch} but torch {torch} is installed (fine for a "
            f'source build of vLLM); otherwise pip install "torch=={tested.torch}"'
        )
    return report
