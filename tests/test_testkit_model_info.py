# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""``npu_testkit.model_info.warm_model_info``: the inspection an engine's front end asks vLLM's registry for is found
cached (no subprocess) and equals what the subprocess would have computed, for vLLM's own entries and ours."""

from __future__ import annotations

from pathlib import Path

import pytest
from npu_testkit.engine import tiny_config
from npu_testkit.model_info import warm_model_info
from npu_testkit.models import build_tiny_model
from vllm.model_executor.models import registry


@pytest.fixture
def no_subprocess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))

    def refuse(fn):
        raise AssertionError("the registry started its inspection subprocess")

    monkeypatch.setattr(registry, "_run_in_subprocess", refuse)


def test_a_checkpoint_s_architectures_are_found_cached(no_subprocess: None) -> None:
    model = build_tiny_model(tiny_config("qwen2"))
    assert warm_model_info(model) == ["Qwen2ForCausalLM"]
    assert warm_model_info(model) == []  # already there
    entry = registry.ModelRegistry.models["Qwen2ForCausalLM"]
    cls = entry.load_model_cls()
    assert entry.inspect_model_cls() == registry._ModelInfo.from_model_cls(cls)


def test_our_override_entries_too(no_subprocess: None, tmp_path: Path) -> None:
    assert warm_model_info(tmp_path, ["PanguProMoEForCausalLM"]) == ["PanguProMoEForCausalLM"]
    entry = registry.ModelRegistry.models["PanguProMoEForCausalLM"]
    assert type(entry).__name__ == "NPULazyModel"
    assert entry.inspect_model_cls() == registry._ModelInfo.from_model_cls(entry.load_model_cls())


def test_a_directory_without_a_config_is_left_to_the_engine(no_subprocess: None, tmp_path: Path) -> None:
    assert warm_model_info(tmp_path) == []
