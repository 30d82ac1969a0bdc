# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Bad input gives a clear error, never a crash or a silent fallback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from npu_testkit.engine import emulated_env, engine
from vllm_npu.interface import ConfigError

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


def test_kv_budget_too_small_for_one_sequence_names_the_emulated_knob(tiny_qwen2, tmp_path):
    # 512 tokens of KV for this model are 2 layers x (K+V) x 2 heads x 16 x 4 bytes x 512 = 256 KiB > 0.0001 GiB.
    # vLLM's own check would say "Try increasing `gpu_memory_utilization`", which the emulated device never reads.
    env = emulated_env(tmp_path, kv_cache_gb=0.0001)
    match = (
        r"VLLM_NPU_EMULATED_KV_CACHE_GB=0.0001 GiB \(0.102 MiB\) is too small for one request of max_model_len=512: "
        r"its KV cache needs 0.250 MiB \(0.000244 GiB\); raise VLLM_NPU_EMULATED_KV_CACHE_GB to at least 0.000244"
    )
    with pytest.raises(ConfigError, match=match), engine(tiny_qwen2, env, max_model_len=512):
        pass


def test_kv_budget_too_small_names_the_additional_config_key(tiny_qwen2, tmp_path):
    bad = {"npu": {"emulated_kv_cache_gb": 0.0001}}
    match = r"npu.emulated_kv_cache_gb=0.0001 GiB .* raise npu.emulated_kv_cache_gb to at least 0.000244"
    with pytest.raises(ConfigError, match=match), engine(tiny_qwen2, emulated_env(tmp_path), additional_config=bad):
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


# --- config and env: every bad VLLM_NPU_* value is our ConfigError, whatever vLLM would do next ------------------


def test_bad_device_value_in_vllm_serve_is_our_config_error(tiny_qwen2, tmp_path):
    # The platform plugin used to decline on the invalid value, and vLLM then failed on "Failed to infer device type".
    env = {**os.environ, **emulated_env(tmp_path), "VLLM_NPU_DEVICE": "bogus"}
    cmd = [str(Path(sys.executable).with_name("vllm")), "serve", str(tiny_qwen2), "--port", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "ConfigError: bad environment: VLLM_NPU_DEVICE='bogus' is invalid" in out
    assert "allowed: 'auto', 'npu', 'emulated', 'off'" in out
    assert "Failed to infer device type" not in out


def test_bad_env_name_with_device_auto_is_our_config_error(tmp_path):
    # VLLM_NPU_DEVICE=auto on a host without an NPU declines the platform; a bad VLLM_NPU_* variable must still be
    # ours (here a typo'd name; the other values: packages/npu-platform/tests/test_register.py).
    env = {**os.environ, **emulated_env(tmp_path), "VLLM_NPU_DEVCE": "emulated"}
    env.pop("VLLM_NPU_DEVICE")
    code = "from vllm.platforms import current_platform\ncurrent_platform.device_type\n"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "ConfigError: bad environment: " in proc.stderr and "VLLM_NPU_DEVCE" in proc.stderr, proc.stderr[-2000:]
    assert "Failed to infer device type" not in proc.stderr


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"npu": {"grph_mode": "eager"}}, r"npu.grph_mode is not a known key; known keys: npu.disabled_patches"),
        ({"npu": {"emulated_kv_cache_gb": "lots"}}, r"npu.emulated_kv_cache_gb='lots' is invalid .*a float in"),
        ({"npu": "eager"}, r"'npu' must be an object like \{\"npu\": \{\"graph_mode\": \"eager\"\}\}, got str"),
        ({"npu": {"kernels": "npu"}}, r"npu.kernels='npu' needs an Ascend NPU"),
        ({"npu": {"torchair_cache": "yes please"}}, r"npu.torchair_cache='yes please' is invalid.*true or false"),
    ],
    ids=["unknown-key", "kv-gb-not-a-number", "section-not-an-object", "kernels-npu", "not-a-bool"],
)
def test_bad_additional_config_values(tiny_qwen2, tmp_path, bad, match):
    with pytest.raises(Exception, match=match), engine(tiny_qwen2, emulated_env(tmp_path), additional_config=bad):
        pass


# --- checkpoints: a quantized checkpoint's load-time fault names the tensor, its shape and the expected one ---------


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (
            "model.layers.0.mlp.gate_proj.weight_scale",
            r"'model.layers.0.mlp.gate_up_proj.weight_scale' \(shard 0 of the fused layer\) has shape \(64, 1\), "
            r"expected \(128, 1\)",
        ),
        (
            "model.layers.1.self_attn.k_proj.weight",
            r"'model.layers.1.self_attn.qkv_proj.weight' \(shard 'k' of the fused layer\) has shape \(16, 64\), "
            r"expected \(32, 64\)",
        ),
    ],
    ids=["gate-scale", "k-weight"],
)
def test_mis_shaped_tensor_of_quantized_checkpoint_is_a_quant_load_error(tmp_path, tensor, match):
    # The tiny Qwen2 quantized W8A8_DYNAMIC by our CLI, then one shard tensor of a fused layer cut to half its rows:
    # vLLM's merged loader used to fail with "RuntimeError: start (0) + length (64) exceeds dimension size (32)".
    from npu_testkit.quant_e2e import tiny_float_model
    from safetensors.torch import load_file, save_file
    from vllm_npu.quant import QuantLoadError
    from vllm_npu.quant.tools.cli import main as quantize_main

    quant_dir = tmp_path / "w8a8_dynamic"
    assert quantize_main([str(tiny_float_model("qwen2")), str(quant_dir), "--scheme", "W8A8_DYNAMIC"]) == 0
    for shard_file in sorted(quant_dir.glob("*.safetensors")):
        tensors = load_file(shard_file)
        if tensor in tensors:
            tensors[tensor] = tensors[tensor][: tensors[tensor].shape[0] // 2].clone()
            save_file(tensors, shard_file, metadata={"format": "pt"})
            break
    else:
        pytest.fail(f"{tensor} not in the quantized checkpoint")
    with pytest.raises(QuantLoadError, match=match), engine(quant_dir, emulated_env(tmp_path)):
        pass
