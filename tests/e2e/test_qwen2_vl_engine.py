# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Real vLLM on the emulated device, tiny Qwen2-VL through npu-models' override of vLLM's class (NPU vision attention on
the reference twins), float32: images of two sizes, a video and text in one batch, chunked prefill and prefix caching
on (cases: ``qwen_vl_cases``)."""

from __future__ import annotations

import pytest
from npu_testkit.sibling import import_sibling

pytestmark = pytest.mark.engine

import_sibling(__file__, "qwen_vl_cases").install(globals(), arch="qwen2_vl")
