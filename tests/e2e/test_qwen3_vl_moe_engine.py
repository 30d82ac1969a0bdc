# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device, tiny Qwen3-VL-MoE through vLLM's own model class, float32: images of two sizes, a
video (with frame timestamps) and text in one batch, chunked prefill and prefix caching on (cases: ``qwen_vl_cases``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

_HERE = Path(__file__).parent


def _load(name: str):
    """Import a helper module of this folder under its own name."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_load("qwen_vl_cases").install(globals(), arch="qwen3_vl_moe", architecture="Qwen3VLMoeForConditionalGeneration")
