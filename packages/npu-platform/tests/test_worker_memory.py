# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUWorker's NPU memory budget (profile run + allocator peak), with a fake NPU device backend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm_npu.interface import DeviceMode
from vllm_npu.platform import worker as worker_mod

GiB = 1 << 30


class FakeNPU:
    """Device numbers of a 64 GiB NPU: 4 GiB used by others at start; the profile run peaks at 10 GiB allocated
    (weights included), leaves 12 GiB reserved and HCCL takes 1 GiB outside torch."""

    type = "npu"
    state = "init"

    @classmethod
    def mem_get_info(cls, device=None):
        return ((60 if cls.state == "init" else 64 - 4 - 12 - 1) * GiB, 64 * GiB)

    @classmethod
    def memory_reserved(cls, device=None):
        return 0 if cls.state == "init" else 12 * GiB

    @staticmethod
    def peak_memory_allocated(device=None):
        return 10 * GiB

    empty_cache = staticmethod(lambda: None)
    reset_peak_memory_stats = staticmethod(lambda device=None: None)
    synchronize = staticmethod(lambda device=None: None)


def make_worker(util: float):
    w = object.__new__(worker_mod.NPUWorker)
    w.device_mode = DeviceMode.NPU
    w.device = torch.device("cpu")
    w.cache_config = SimpleNamespace(kv_cache_memory_bytes=None, gpu_memory_utilization=util)
    FakeNPU.state = "init"
    w.init_free_memory, w.total_memory = FakeNPU.mem_get_info()
    w.init_non_torch_memory = (w.total_memory - w.init_free_memory) - FakeNPU.memory_reserved()
    w.requested_memory = w.total_memory * util

    def profile_run():
        FakeNPU.state = "profiled"

    w.model_runner = SimpleNamespace(profile_run=profile_run)
    return w


def test_npu_kv_budget_is_requested_minus_peak_minus_non_torch_increase(monkeypatch):
    monkeypatch.setattr(worker_mod, "device_backend", lambda: FakeNPU)
    w = make_worker(0.9)
    available = w.determine_available_memory()
    assert available == int(0.9 * 64 * GiB - 10 * GiB - 1 * GiB)


def test_npu_budget_exhausted_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(worker_mod, "device_backend", lambda: FakeNPU)
    w = make_worker(0.15)  # 9.6 GiB allowed < 10 GiB peak
    with pytest.raises(ValueError, match="no NPU memory left for the KV cache.*raise --gpu-memory-utilization"):
        w.determine_available_memory()


def test_npu_kv_budget_leaves_room_for_the_graph_pool(monkeypatch):
    monkeypatch.setattr(worker_mod, "device_backend", lambda: FakeNPU)
    w = make_worker(0.9)
    w.model_runner.estimate_graph_memory = lambda: 3 * GiB  # one forward's activations at the largest capture size
    assert w.determine_available_memory() == int(0.9 * 64 * GiB - 10 * GiB - 1 * GiB - 3 * GiB)
    w = make_worker(0.2)  # 12.8 GiB allowed: weights + HCCL fit, the graph pool does not
    w.model_runner.estimate_graph_memory = lambda: 3 * GiB
    with pytest.raises(ValueError, match=r"\+3.00 GiB for the graph pool.*or the capture sizes"):
        w.determine_available_memory()
