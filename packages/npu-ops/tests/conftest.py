# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Shared fixtures of the ops layer's tests: emulated device, a vLLM config context, a one-rank process group.

The device mode is fixed per process on first use, so ``VLLM_NPU_DEVICE=emulated`` is set at import time (before
any test module resolves vLLM's platform or our kernel backend).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from npu_testkit.distributed import tp1_group  # noqa: F401 (the shared per-test fixture)

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture(scope="session")
def oot_registered() -> list[str]:
    """Register the ops layer's CustomOp overrides (idempotent) and return the vLLM names now overridden."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm_npu.ops._registry import register_oot_ops

    register_oot_ops()
    return sorted(CustomOp.op_registry_oot)


@pytest.fixture
def vllm_ctx(oot_registered: list[str]) -> Iterator[object]:
    """A default VllmConfig as the current config, so layers can be built without an engine."""
    from vllm.config import VllmConfig, set_current_vllm_config

    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        yield cfg
