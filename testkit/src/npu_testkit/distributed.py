# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A one-rank vLLM process group, for tests that build real vLLM layers without an engine.

:func:`single_rank_group` is the context manager; :func:`tp1_group` the per-test pytest fixture around it (a package's
``conftest.py`` imports it, which is how pytest finds it there).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def single_rank_group() -> Iterator[None]:
    """vLLM's world, TP and PP groups with one rank over gloo (linear, embedding and MoE layers need them).

    Reuses the groups when this process already has them (another fixture or module set them up); otherwise creates
    them and destroys them on exit.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        yield None
        return
    with tempfile.TemporaryDirectory() as d:
        # A config is current only while the groups are created: the caller's own current config (if any) must stay
        # the one its layers register into.
        with set_current_vllm_config(VllmConfig()):
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{d}/pg", backend="gloo"
            )
            ps.initialize_model_parallel(1, 1)
        try:
            yield None
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


@pytest.fixture
def tp1_group() -> Iterator[None]:
    """A single-rank gloo process group with vLLM's TP/PP groups (needed to build linear/embedding/MoE layers).

    Per test, not per session: an engine shut down by another module on the same xdist worker destroys vLLM's
    process groups, so a session-wide group could vanish under later tests."""
    with single_rank_group():
        yield None
