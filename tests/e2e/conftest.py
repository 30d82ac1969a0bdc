# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Shared fixtures of the end-to-end suite: real vLLM 0.11 on the emulated device, tiny models built on the fly.

vLLM resolves its platform once per process, so the emulated device is selected here, when pytest imports this
conftest, before any test module imports vLLM. Every test module starts at most one engine (module scope) through
``npu_testkit.engine.engine``.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")

import pytest  # noqa: E402
from npu_testkit.engine import make_prompts, tiny_config  # noqa: E402
from npu_testkit.models import build_tiny_model  # noqa: E402

#: Prompt lengths of the batched tests: very different lengths in one batch (1 to 150 tokens).
PROMPT_LENGTHS = [1, 5, 8, 40, 150]


@pytest.fixture(scope="session")
def tiny_qwen2():
    return build_tiny_model(tiny_config("qwen2"))


@pytest.fixture(scope="session")
def tiny_llama():
    return build_tiny_model(tiny_config("llama"))


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return make_prompts(PROMPT_LENGTHS, seed=1)
