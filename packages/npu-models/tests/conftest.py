# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Fixtures of the models layer's tests: the emulated device (reference kernels) and a one-rank process group
(vLLM's linear layers need the TP group to be built)."""

from __future__ import annotations

import os

from npu_testkit.distributed import tp1_group  # noqa: F401 (the shared per-test fixture)

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
