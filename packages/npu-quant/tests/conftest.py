# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Fixtures of the quant layer's tests: emulated device (reference kernels), a one-rank process group
(``tp1_group``, from npu_testkit) and a current default VllmConfig on top of it (``vllm_ctx``), so the test modules
can build real vLLM linear and MoE layers with the ``ascend`` quant config; and this directory on ``sys.path`` for
the helper module ``quant_moe_harness``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from npu_testkit.distributed import tp1_group  # noqa: F401 (the shared per-test fixture)

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
# the tests' helper module (quant_moe_harness) importable under --import-mode=importlib
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture
def vllm_ctx(tp1_group: None) -> Iterator[object]:  # noqa: F811 (requests the imported fixture)
    from vllm.config import VllmConfig, set_current_vllm_config

    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        yield cfg
