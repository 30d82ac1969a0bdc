# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm-ascend settings get a message each: a warning where ignoring them keeps outputs and memory, an error where it
would not, one warning for unknown VLLM_ASCEND_* names (one test per category)."""

from __future__ import annotations

import pytest
from vllm_npu.interface.ascend_migration import check_ascend_settings, find_ascend_settings
from vllm_npu.interface.errors import ConfigError


def messages(additional_config=None, environ=None) -> list[tuple[str, str]]:
    return [(f.severity, f.message) for f in find_ascend_settings(additional_config, environ or {})]


def test_nothing_from_vllm_ascend_means_no_message() -> None:
    assert messages({"npu": {"graph_mode": "eager"}, "another_plugin": 1}, {"VLLM_NPU_DEVICE": "emulated"}) == []


def test_a_performance_key_is_a_warning_naming_our_equivalent() -> None:
    [(severity, message)] = messages({"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [1, 2]}})
    assert severity == "warning"
    assert message.startswith(
        "--additional-config torchair_graph_config={'enabled': True, 'graph_batch_sizes': [1, 2]} is a vllm-ascend "
        "setting (TorchAir (GE) graph mode and its capture options) and is ignored by vllm-npu-plugin; here: our "
        "graph mode is --additional-config '{\"npu\": {\"graph_mode\": <mode>}}' with <mode> one of 'auto'"
    )


def test_a_semantic_key_is_an_error_saying_not_supported_yet() -> None:
    [(severity, message)] = messages({"lmhead_tensor_parallel_size": 2})
    assert severity == "error"
    assert "lmhead_tensor_parallel_size=2 is a vllm-ascend setting" in message and "cannot be ignored" in message
    assert "here: not supported yet by vllm-npu-plugin" in message


def test_kv_cache_dtype_int8_is_a_warning_pointing_at_c8_checkpoints() -> None:
    # vllm-ascend needs it beside a C8 checkpoint; here the checkpoint itself selects the int8 cache (issue #30)
    [(severity, message)] = messages({"kv_cache_dtype": "int8"})
    assert severity == "warning"
    assert "kv_cache_dtype='int8' is a vllm-ascend setting (an int8-quantised KV cache) and is ignored" in message
    assert "a C8 checkpoint (kv_quant_type or kv_cache_type 'C8'" in message


def test_a_performance_variable_is_a_warning() -> None:
    [(severity, message)] = messages(environ={"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"})
    assert severity == "warning"
    assert message.startswith("environment VLLM_ASCEND_ENABLE_FLASHCOMM1='1' is a vllm-ascend setting")
    assert message.endswith("here: a performance option; not supported yet by vllm-npu-plugin")


def test_a_semantic_variable_is_an_error_naming_our_equivalent() -> None:
    [(severity, message)] = messages(environ={"USE_OPTIMIZED_MODEL": "0"})
    assert severity == "error"
    assert message.endswith(
        "here: leave npu_models out of VLLM_PLUGINS (VLLM_PLUGINS=npu,npu_ops,npu_attention,npu_quant,npu_patches)"
    )


def test_an_error_whose_replacement_is_already_in_place_is_only_a_warning() -> None:
    [(severity, message)] = messages(environ={"USE_OPTIMIZED_MODEL": "0", "VLLM_PLUGINS": "npu,npu_ops,npu_attention"})
    assert severity == "warning"
    assert message.endswith("npu_quant,npu_patches): done, you can unset it")


@pytest.mark.parametrize(
    ("additional_config", "environ"),
    [
        ({"kv_cache_dtype": None}, {}),
        ({"lmhead_tensor_parallel_size": None}, {}),
        ({"expert_map_path": ""}, {}),
        ({}, {"USE_OPTIMIZED_MODEL": "1"}),
        ({}, {"VLLM_ASCEND_LLMDD_RPC_PORT": "5557"}),
    ],
)
def test_a_setting_left_at_vllm_ascends_default_is_only_a_warning(additional_config, environ) -> None:
    [(severity, _)] = messages(additional_config, environ)
    assert severity == "warning"


def test_unknown_vllm_ascend_variables_are_listed_in_one_warning() -> None:
    found = messages(environ={"VLLM_ASCEND_ENABLE_FOO": "1", "VLLM_ASCEND_BAR": "x", "VLLM_ASCEND_MLA_PA": "1"})
    assert [s for s, _ in found] == ["warning", "warning"]
    assert found[1][1] == (
        "environment: VLLM_ASCEND_BAR, VLLM_ASCEND_ENABLE_FOO are not read by vllm-npu-plugin (nor a vllm-ascend "
        "v0.11.0 variable it knows); the plugin's variables start with VLLM_NPU_"
    )


def test_check_warns_each_warning_and_raises_once_for_all_errors() -> None:
    warned: list[str] = []
    config = {"refresh": True, "lmhead_tensor_parallel_size": 2, "expert_map_path": "/maps/dsv3.json"}
    with pytest.raises(ConfigError) as info:
        check_ascend_settings(config, {"VLLM_ASCEND_LLMDD_RPC_IP": "10.0.0.2"}, warn=warned.append)
    assert len(warned) == 1 and warned[0].startswith("--additional-config refresh=True")
    text = str(info.value)
    assert text.startswith("vllm-ascend settings that vllm-npu-plugin would otherwise ignore")
    for name in ("lmhead_tensor_parallel_size=2", "expert_map_path='/maps/dsv3.json'", "VLLM_ASCEND_LLMDD_RPC_IP"):
        assert name in text
