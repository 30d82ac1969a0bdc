"""Fixtures of the models layer's tests: the emulated device (reference kernels) and a one-rank process group
(vLLM's linear layers need the TP group to be built)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

os.environ.setdefault("VLLM_NPU_DEVICE", "emulated")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture(scope="session")
def tp1_group() -> Iterator[None]:
    """A single-rank gloo process group with vLLM's TP/PP groups."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        yield None
        return
    with tempfile.TemporaryDirectory() as d, set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{d}/pg", backend="gloo"
        )
        ps.initialize_model_parallel(1, 1)
        try:
            yield None
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
