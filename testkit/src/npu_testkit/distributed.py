# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A one-rank vLLM process group, for tests that build real vLLM layers without an engine; and rank-worker scripts
run as one process per rank (:func:`run_rank_workers`, :func:`load_worker`).

:func:`single_rank_group` is the context manager; :func:`tp1_group` the per-test pytest fixture around it (a package's
``conftest.py`` imports it, which is how pytest finds it there).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

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


def load_worker(path: Path) -> ModuleType:
    """The rank-worker script ``path`` as a module (its scenarios and input builders, for the test's checks)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_rank_workers(worker: Path, world: int, out_dir: Path, *, timeout: float = 240) -> list[Any]:
    """Run ``python <worker> <rank> <world> file://<out_dir>/pg <out_dir>`` for every rank at once on the emulated
    device (they rendezvous over gloo), fail with every rank's output if one fails, and return what each saved to
    ``<out_dir>/rank<r>.pt``."""
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_NPU_DEVICE": "emulated"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), str(world), f"file://{out_dir}/pg", str(out_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
