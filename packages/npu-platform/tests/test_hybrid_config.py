# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Hybrid models' config checks (vllm_npu.platform.hybrid) and the hybrid KV-cache switch of the platform."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm_npu.interface import ConfigError
from vllm_npu.platform.hybrid import check_hybrid_config
from vllm_npu.platform.platform import NPUPlatform


def _config(hybrid: bool = True, **over: Any) -> SimpleNamespace:
    base: dict[str, Any] = {
        "model_config": SimpleNamespace(is_hybrid=hybrid, architecture="Qwen3NextForCausalLM"),
        "kv_transfer_config": None,
        "kv_events_config": None,
        "scheduler_config": SimpleNamespace(disable_hybrid_kv_cache_manager=False),
    }
    base.update(over)
    return SimpleNamespace(**base)


def test_the_platform_offers_vllms_hybrid_kv_cache_manager() -> None:
    assert NPUPlatform.support_hybrid_kv_cache() is True


@pytest.mark.parametrize(
    ("over", "names"),
    [
        ({"kv_transfer_config": object()}, "--kv-transfer-config"),
        ({"kv_events_config": object()}, "--kv-events-config"),
        ({"scheduler_config": SimpleNamespace(disable_hybrid_kv_cache_manager=True)}, "--disable-hybrid-kv-cache"),
    ],
)
def test_a_hybrid_with_what_turns_the_hybrid_manager_off_is_refused_by_name(over: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError, match=names) as err:
        check_hybrid_config(_config(**over))
    assert "Qwen3NextForCausalLM" in str(err.value)


def test_a_plain_hybrid_passes_with_a_warning_and_a_dense_model_is_left_alone(caplog: Any) -> None:
    check_hybrid_config(_config())
    assert "prefix caching is off" in caplog.text
    caplog.clear()
    check_hybrid_config(_config(hybrid=False, kv_transfer_config=object()))
    assert caplog.text == ""
