# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Bad input gives a clear error, never a crash or a silent fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from npu_testkit.engine import emulated_env, engine

pytestmark = pytest.mark.engine


def test_npu_requested_on_host_without_npu_is_a_clear_error(tiny_qwen2, tmp_path):
    # A user's script in a fresh process: vLLM instantiates NPUPlatform on first touch of current_platform.
    env = {**os.environ, **emulated_env(tmp_path), "VLLM_NPU_DEVICE": "npu"}
    env.pop("ASCEND_RT_VISIBLE_DEVICES", None)
    code = f"from vllm import LLM\nLLM(model={str(tiny_qwen2)!r})\n"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "DeviceUnavailableError: VLLM_NPU_DEVICE=npu was requested but this host cannot run it" in proc.stderr
    assert "set VLLM_NPU_DEVICE=emulated" in proc.stderr


def test_kv_budget_too_small_for_one_sequence_gives_vllm_error(tiny_qwen2, tmp_path):
    # 512 tokens of KV for this model are 2 layers x (K+V) x 2 heads x 16 x 4 bytes x 512 = 256 KiB > 0.0001 GiB.
    env = emulated_env(tmp_path, kv_cache_gb=0.0001)
    match = r"To serve at least one request with the models's max seq len \(512\)"
    with pytest.raises(ValueError, match=match), engine(tiny_qwen2, env, max_model_len=512):
        pass


def test_bad_emulated_kv_budget_names_the_variable(tiny_qwen2, tmp_path):
    # The platform validates VLLM_NPU_* when vLLM instantiates it (a fresh process, like a user's).
    env = {**os.environ, **emulated_env(tmp_path), "VLLM_NPU_EMULATED_KV_CACHE_GB": "-1"}
    code = "from vllm.platforms import current_platform\ncurrent_platform.device_type\n"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "ConfigError: bad environment: VLLM_NPU_EMULATED_KV_CACHE_GB='-1' is invalid" in proc.stderr
    assert "allowed: a float in (0, 1024]" in proc.stderr


def test_bad_additional_config_names_the_key(tiny_qwen2, tmp_path):
    # Raised in check_and_update_config; vLLM's pydantic VllmConfig wraps it, the message names key and choices.
    match = r"npu.graph_mode='fast' is invalid .*allowed: one of 'auto', 'eager', 'piecewise'"
    bad = {"npu": {"graph_mode": "fast"}}
    with pytest.raises(Exception, match=match), engine(tiny_qwen2, emulated_env(tmp_path), additional_config=bad):
        pass


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"compilation_config": {"cudagraph_mode": "FULL"}},
            r"compilation_config.cudagraph_mode=FULL is not supported",
        ),
        (
            {"compilation_config": {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [4, 100000]}},
            r"compilation_config.cudagraph_capture_sizes holds \[100000\]",
        ),
        (
            {"enforce_eager": True, "additional_config": {"npu": {"graph_mode": "full_decode_only"}}},
            r"npu.graph_mode='full_decode_only' conflicts with enforce_eager=True",
        ),
    ],
)
def test_bad_graph_settings_name_the_key(tiny_qwen2, tmp_path, kwargs, match):
    # Raised in check_and_update_config while vLLM builds its config: no engine starts.
    with pytest.raises(Exception, match=match), engine(tiny_qwen2, emulated_env(tmp_path), **kwargs):
        pass
