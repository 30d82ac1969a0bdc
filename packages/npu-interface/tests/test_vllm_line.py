# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The tested vLLM releases and the gate: a vLLM outside them is refused with one message (installed version, tested
releases, install line, the override), and VLLM_NPU_ALLOW_UNTESTED_VLLM=1 turns the refusal into a warning."""

from __future__ import annotations

import logging

import pytest
from vllm_npu.interface import settings, vllm_line
from vllm_npu.interface.component import Component
from vllm_npu.interface.errors import ComponentSkewError, ConfigError
from vllm_npu.interface.registry import ComponentReport, check_installed_set, compatibility_problems
from vllm_npu.interface.versions import SUPPORTED_VLLM, in_range, release_key


def test_supported_range_admits_exactly_the_tested_releases() -> None:
    tested = [r.vllm for r in vllm_line.TESTED_RELEASES]
    assert tested == ["0.11.0", "0.11.1", "0.11.2"]
    for version in (*tested, "0.11.1+cpu"):
        assert in_range(version, SUPPORTED_VLLM, what="test")
    # a release enters only when its compatibility job passes (docs/vllm-compat.md); none waits today
    assert vllm_line.PREVIEW_RELEASES == ()
    for version in ("0.10.2", "0.11.3", "0.12.0", "0.12.0rc1"):
        assert not in_range(version, SUPPORTED_VLLM, what="test"), version
    assert vllm_line.PINNED_RELEASE.vllm == "0.11.0" and vllm_line.PINNED_RELEASE.torch == "2.8.0"


def test_each_release_pairs_torch_and_the_ascend_pair() -> None:
    releases = (*vllm_line.TESTED_RELEASES, *vllm_line.PREVIEW_RELEASES)
    assert {r.vllm: r.torch for r in releases} == {
        "0.11.0": "2.8.0",
        "0.11.1": "2.9.0",
        "0.11.2": "2.9.0",
    }
    assert {(r.ascend_torch, r.torch_npu) for r in releases} == {("2.8.0", "2.8.0")}
    assert vllm_line.release("0.11.1+cpu") == vllm_line.TESTED_RELEASES[1]
    assert vllm_line.release("0.12.0") is None


def test_the_env_name_is_the_settings_one() -> None:
    assert vllm_line.ENV_ALLOW_UNTESTED_VLLM == settings.ENV_ALLOW_UNTESTED_VLLM
    assert settings.setting(settings.ENV_ALLOW_UNTESTED_VLLM).default == "0"


def test_the_refusal_names_installed_tested_install_line_and_override() -> None:
    message = vllm_line.untested_vllm("0.12.0", SUPPORTED_VLLM)
    assert message is not None
    assert message.startswith("vLLM 0.12.0 is installed, but this vllm-npu-plugin line is tested on vLLM ")
    assert "tested on vLLM 0.11.0, 0.11.1, 0.11.2 only" in message and repr(SUPPORTED_VLLM) in message
    assert 'pip install "vllm==0.11.2" (torch 2.9.0 comes with it)' in message
    assert "VLLM_NPU_ALLOW_UNTESTED_VLLM=1" in message and "untested: expect failures" in message
    assert vllm_line.untested_vllm("0.11.0", SUPPORTED_VLLM) is None
    assert vllm_line.untested_vllm("0.11.0+cpu", SUPPORTED_VLLM) is None
    assert vllm_line.untested_vllm("0.11.2", SUPPORTED_VLLM) is None
    assert vllm_line.untested_vllm(None, SUPPORTED_VLLM) is None  # not installed: a missing requirement instead


def test_a_preview_release_is_refused_with_its_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    # The mechanism a next release goes through before its job passes (none is a preview today).
    monkeypatch.setattr(vllm_line, "PREVIEW_RELEASES", (vllm_line.Release("0.11.3", torch="2.9.0"),))
    monkeypatch.setattr(vllm_line, "PREVIEW_GAPS", "MoE models diverge from HF")
    preview = vllm_line.untested_vllm("0.11.3", SUPPORTED_VLLM)
    assert preview is not None and "preview of this line" in preview and "MoE models diverge from HF" in preview
    assert vllm_line.untested_vllm(None, SUPPORTED_VLLM) is None  # not installed: a missing requirement instead


def test_require_tested_vllm_raises_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NPU_ALLOW_UNTESTED_VLLM", raising=False)
    with pytest.raises(ConfigError, match=r"vLLM 0\.12\.0 is installed"):
        vllm_line.require_tested_vllm(SUPPORTED_VLLM, vllm_version="0.12.0")
    vllm_line.require_tested_vllm(SUPPORTED_VLLM, vllm_version="0.11.0")  # tested: no error


def test_the_override_warns_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("VLLM_NPU_ALLOW_UNTESTED_VLLM", "1")
    monkeypatch.setattr(vllm_line, "_warned", set())
    with caplog.at_level(logging.WARNING):
        vllm_line.require_tested_vllm(SUPPORTED_VLLM, vllm_version="0.12.0")
        vllm_line.require_tested_vllm(SUPPORTED_VLLM, vllm_version="0.12.0")
    warnings = [r.getMessage() for r in caplog.records if "running anyway" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith("VLLM_NPU_ALLOW_UNTESTED_VLLM=1: running anyway. vLLM 0.12.0 is installed")


@pytest.mark.parametrize("value", ["0", "", "true", "yes"])
def test_only_1_allows(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("VLLM_NPU_ALLOW_UNTESTED_VLLM", value)
    assert not vllm_line.allow_untested()


def test_every_layer_gives_the_same_single_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NPU_ALLOW_UNTESTED_VLLM", raising=False)
    layers = [
        Component(name, f"npu-{name}", "0.1.0", interface=">=1.0,<2", vllm=SUPPORTED_VLLM)
        for name in ("ops", "attention", "quant")
    ]
    problems = [compatibility_problems(c, vllm_version="0.12.0") for c in layers]
    assert problems[0] == problems[1] == problems[2] == [vllm_line.untested_vllm("0.12.0", SUPPORTED_VLLM)]
    reports = {c.name: ComponentReport(c.name, c, True, tuple(p)) for c, p in zip(layers, problems, strict=True)}
    with pytest.raises(ComponentSkewError) as info:
        check_installed_set(reports)
    assert str(info.value).count("vLLM 0.12.0 is installed") == 1


def test_allowed_untested_vllm_is_no_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NPU_ALLOW_UNTESTED_VLLM", "1")
    comp = Component("ops", "npu-ops", "0.1.0", interface=">=1.0,<2", vllm=SUPPORTED_VLLM)
    assert compatibility_problems(comp, vllm_version="0.12.0") == []


def test_release_key_orders_releases() -> None:
    assert release_key("0.11.2") == (0, 11, 2)
    assert release_key("0.11.2+cpu") == (0, 11, 2)
    assert release_key("0.12.0rc1") == (0, 12, 0)
    assert release_key("0.11.10") > release_key("0.11.9")
