# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The compilation level where the installed vLLM keeps it: ``level`` (0.11.0) or ``mode`` (0.11.1, which maps a
user's ``level`` onto ``mode`` and then ignores it)."""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass

import pytest
from vllm_npu.interface.compilation import NO_COMPILATION, PIECEWISE, compilation_level, set_compilation_level


@dataclass
class Config0110:
    level: int | None = None


class CompilationMode(enum.IntEnum):
    NONE = 0
    VLLM_COMPILE = 3


@dataclass
class Config0111:
    level: int | None = None
    mode: CompilationMode | None = None


def test_vllm_0_11_0_keeps_the_level() -> None:
    config = Config0110()
    assert compilation_level(config) is None
    set_compilation_level(config, PIECEWISE)
    assert config.level == 3 and compilation_level(config) == 3


def test_vllm_0_11_1_keeps_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("vllm.config.compilation")
    module.CompilationMode = CompilationMode  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.config.compilation", module)
    config = Config0111(level=3, mode=CompilationMode.VLLM_COMPILE)
    set_compilation_level(config, NO_COMPILATION)
    assert config.mode is CompilationMode.NONE and compilation_level(config) == 0
    assert config.level == 3  # dead after vLLM's __post_init__: left alone
