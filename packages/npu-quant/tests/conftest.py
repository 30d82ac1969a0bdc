"""Fixtures of the quant layer's tests: emulated device (reference kernels), a one-rank process group, helpers that
build real vLLM linear layers with the ``ascend`` quant config and load tensors into them through vLLM's loaders."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from npu_testkit.distributed import tp1_group  # noqa: F401 (the shared per-test fixture)

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture
def vllm_ctx(tp1_group: None) -> Iterator[object]:  # noqa: F811 (requests the imported fixture)
    from vllm.config import VllmConfig, set_current_vllm_config

    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        yield cfg
