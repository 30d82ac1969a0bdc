"""Fixtures of the quant layer's tests: emulated device (reference kernels), a one-rank process group, helpers that
build real vLLM linear layers with the ``ascend`` quant config and load tensors into them through vLLM's loaders."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture
def tp1_group() -> Iterator[None]:
    """A single-rank gloo process group with vLLM's TP/PP groups (needed to build linear/embedding/MoE layers).

    Per test, not per session: an engine shut down by another module on the same xdist worker destroys vLLM's
    process groups, so a session-wide group could vanish under later tests."""
    from npu_testkit.distributed import single_rank_group

    with single_rank_group():
        yield None


@pytest.fixture
def vllm_ctx(tp1_group: None) -> Iterator[object]:
    from vllm.config import VllmConfig, set_current_vllm_config

    cfg = VllmConfig()
    with set_current_vllm_config(cfg):
        yield cfg
