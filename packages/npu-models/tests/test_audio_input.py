# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The audio-decoder warning: an audio model built where librosa is missing says so once, naming the install line;
not when librosa is there, nor when the deployment turns audio off."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_npu.models import audio_input


def _config(audio_limit: int | None = None) -> Any:
    limits = {} if audio_limit is None else {"audio": audio_limit}
    mm = SimpleNamespace(get_limit_per_prompt=lambda modality: limits.get(modality, 999))
    return SimpleNamespace(model_config=SimpleNamespace(multimodal_config=mm))


@pytest.fixture
def warnings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(audio_input.logger, "warning", lambda fmt, *args: seen.append(fmt % args))
    return seen


@pytest.fixture
def no_librosa(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        audio_input.importlib.util, "find_spec", lambda name, *a: None if name == "librosa" else real(name, *a)
    )


def test_missing_decoder_warns_once_with_the_install_line(no_librosa: None, warnings: list[str]) -> None:
    assert audio_input.warn_without_audio_decoder("TinyAudioA", _config()) is True
    assert audio_input.warn_without_audio_decoder("TinyAudioA", _config()) is False  # once per process
    (message,) = warnings
    assert "TinyAudioA" in message and "librosa" in message and "input_audio" in message
    assert message.endswith('pip install "npu-platform[audio]"')


def test_no_warning_when_audio_is_turned_off(no_librosa: None, warnings: list[str]) -> None:
    assert audio_input.warn_without_audio_decoder("TinyAudioB", _config(audio_limit=0)) is False
    assert warnings == []


def test_no_warning_with_librosa(monkeypatch: pytest.MonkeyPatch, warnings: list[str]) -> None:
    monkeypatch.setattr(audio_input.importlib.util, "find_spec", lambda name, *a: SimpleNamespace(name=name))
    assert audio_input.missing_audio_decoder("TinyAudioC") is None
    assert audio_input.warn_without_audio_decoder("TinyAudioC", _config()) is False
    assert warnings == []


@pytest.mark.parametrize(
    ("override", "base", "arch"),
    [
        ("AscendQwen2AudioForConditionalGeneration", "Qwen2AudioForConditionalGeneration", "Qwen2Audio"),
        ("AscendQwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5OmniThinkerForConditionalGeneration", "Omni"),
    ],
)
def test_audio_models_warn_at_build(
    monkeypatch: pytest.MonkeyPatch, no_librosa: None, warnings: list[str], override: str, base: str, arch: str
) -> None:
    from vllm_npu.models import multimodal

    monkeypatch.setattr(getattr(multimodal, base), "__init__", lambda self, **kw: setattr(self, "visual", None))
    monkeypatch.setattr(multimodal, "adopt_encoder_attention", lambda *a, **kw: None)
    monkeypatch.setattr(audio_input, "once", lambda key, fn: fn() is None)  # every build warns here
    getattr(multimodal, override)(vllm_config=_config(), prefix="")
    assert len(warnings) == 1 and 'pip install "npu-platform[audio]"' in warnings[0], warnings
