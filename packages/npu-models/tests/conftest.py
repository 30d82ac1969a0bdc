"""Fixtures of the models layer's tests: the emulated device (reference kernels) and a one-rank process group
(vLLM's linear layers need the TP group to be built)."""

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
