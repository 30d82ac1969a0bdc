# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The scoped CUDA stream-API shim of the model runner and the emulated KV budget."""

from __future__ import annotations

import threading

import pytest
import torch
from vllm_npu.interface import ConfigError
from vllm_npu.platform._device import EmulatedDevice, cuda_stream_api_as

NAMES = ("Stream", "Event", "current_stream", "default_stream", "stream")


def test_shim_is_scoped_and_restored_on_error():
    real = {n: getattr(torch.cuda, n) for n in NAMES}
    with pytest.raises(RuntimeError, match="boom"), cuda_stream_api_as(EmulatedDevice):
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
        assert torch.cuda.default_stream() == torch.cuda.current_stream()
        raise RuntimeError("boom")
    assert {n: getattr(torch.cuda, n) for n in NAMES} == real
    # Objects made inside keep working outside (vLLM keeps them for the runner's lifetime).
    event.record()
    event.synchronize()


def test_overlapping_shims_on_threads_restore_once():
    real = {n: getattr(torch.cuda, n) for n in NAMES}
    inside = threading.Event()
    release = threading.Event()

    def worker():
        with cuda_stream_api_as(EmulatedDevice):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(10)
    with cuda_stream_api_as(EmulatedDevice):
        pass
    assert torch.cuda.Event is not real["Event"]  # the other thread is still inside
    release.set()
    t.join(10)
    assert {n: getattr(torch.cuda, n) for n in NAMES} == real


def test_emulated_kv_budget_sources_and_validation(monkeypatch):
    from vllm_npu.platform.worker import emulated_kv_cache_bytes

    assert emulated_kv_cache_bytes({}, {"VLLM_NPU_EMULATED_KV_CACHE_GB": "0.25"}) == 1 << 28
    assert (
        emulated_kv_cache_bytes({"npu": {"emulated_kv_cache_gb": 0.125}}, {"VLLM_NPU_EMULATED_KV_CACHE_GB": "0.25"})
        == 1 << 27
    )
    assert emulated_kv_cache_bytes({}, {}) == 1 << 29  # the documented default, 0.5 GiB
    with pytest.raises(ConfigError, match="exceeds the host's available memory"):
        emulated_kv_cache_bytes({}, {"VLLM_NPU_EMULATED_KV_CACHE_GB": "1024"})
    with pytest.raises(ConfigError, match="npu.emulated_kv_cache_gb=-1"):
        emulated_kv_cache_bytes({"npu": {"emulated_kv_cache_gb": -1}}, {})


def test_synchronize_shim_is_the_backends_and_restored():
    from vllm_npu.platform._device import cuda_synchronize_as

    real = torch.cuda.synchronize
    calls = []

    class Recording(EmulatedDevice):
        @staticmethod
        def synchronize(device=None):
            calls.append(device)

    with pytest.raises(RuntimeError, match="boom"), cuda_synchronize_as(Recording):
        with cuda_synchronize_as(Recording):  # nested: restored once, by the outer block
            torch.cuda.synchronize()
        torch.cuda.synchronize("cpu")  # what vLLM's EPLB rearrangement calls (no CUDA here)
        raise RuntimeError("boom")
    assert calls == [None, "cpu"]
    assert torch.cuda.synchronize is real
