# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU device's one-time torch_npu configuration, checked against a stand-in (no torch_npu here)."""

from __future__ import annotations

import sys
import types

import torch
from vllm_npu.platform import _device


def test_first_device_call_turns_internal_formats_off(monkeypatch) -> None:
    """``allow_internal_format`` is set explicitly (False), not left to the chip's / build's default."""
    config = types.SimpleNamespace(allow_internal_format="unset")
    npu = types.SimpleNamespace(config=config, set_device=lambda device: None)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    _device._torch_npu.cache_clear()
    try:
        _device.NPUDevice.set_device(torch.device("cpu"))
        assert config.allow_internal_format is False
    finally:
        _device._torch_npu.cache_clear()
