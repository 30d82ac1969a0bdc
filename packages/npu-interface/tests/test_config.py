# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The VLLM_NPU_* environment schema and the ``npu`` section of --additional-config."""

from __future__ import annotations

from typing import get_args

import pytest
from vllm_npu.interface import ADDITIONAL_CONFIG_KEY, AdditionalConfig, ConfigError, EnvConfig
from vllm_npu.interface.settings import ADDITIONAL_CONFIG_SETTINGS, ENV_PREFIX, ENV_SETTINGS, Setting, setting


def test_env_defaults() -> None:
    env = EnvConfig.from_environ({"PATH": "/usr/bin", "VLLM_PLUGINS": "npu"})
    assert (env.DEVICE, env.EMULATED_KV_CACHE_GB, env.PATCHES) == ("auto", 0.5, "all")
    assert env.disabled_patches == frozenset()


def test_env_values_are_parsed() -> None:
    env = EnvConfig.from_environ(
        {"VLLM_NPU_DEVICE": " Emulated ", "VLLM_NPU_EMULATED_KV_CACHE_GB": "2.5", "VLLM_NPU_PATCHES": "-a, -b"}
    )
    assert env.DEVICE == "emulated"
    assert env.EMULATED_KV_CACHE_GB == 2.5
    assert env.disabled_patches == frozenset({"a", "b"})
    assert EnvConfig.from_environ({"VLLM_NPU_PATCHES": "none"}).disabled_patches == frozenset({"*"})


def test_unknown_env_variable_is_named_with_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        EnvConfig.from_environ({"VLLM_NPU_DEVCE": "emulated"})
    message = str(info.value)
    assert "VLLM_NPU_DEVCE is not a known key" in message
    for known in ("VLLM_NPU_DEVICE", "VLLM_NPU_EMULATED_KV_CACHE_GB", "VLLM_NPU_PATCHES"):
        assert known in message


def test_bad_device_names_the_allowed_values() -> None:
    with pytest.raises(ConfigError) as info:
        EnvConfig.from_environ({"VLLM_NPU_DEVICE": "gpu"})
    message = str(info.value)
    assert "VLLM_NPU_DEVICE" in message and "'gpu'" in message
    for allowed in ("'auto'", "'npu'", "'emulated'", "'off'"):
        assert allowed in message


@pytest.mark.parametrize("bad", ["0", "-1", "big", "2000"])
def test_bad_kv_cache_size(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        EnvConfig.from_environ({"VLLM_NPU_EMULATED_KV_CACHE_GB": bad})
    message = str(info.value)
    assert f"VLLM_NPU_EMULATED_KV_CACHE_GB={bad!r}" in message
    assert "(0, 1024]" in message


def test_bad_patch_list() -> None:
    with pytest.raises(ConfigError) as info:
        EnvConfig.from_environ({"VLLM_NPU_PATCHES": "-a,b"})
    message = str(info.value)
    assert "VLLM_NPU_PATCHES" in message and "-<patch-id>" in message


def test_every_error_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        EnvConfig.from_environ({"VLLM_NPU_EMULATED_KV_CACHE_GB": "-1", "VLLM_NPU_TYPO": "x"})
    message = str(info.value)
    assert "VLLM_NPU_EMULATED_KV_CACHE_GB" in message and "VLLM_NPU_TYPO" in message


def test_env_config_is_frozen() -> None:
    env = EnvConfig.from_environ({})
    with pytest.raises(Exception, match="frozen"):
        env.DEVICE = "npu"  # type: ignore[misc]


def test_additional_config_defaults() -> None:
    for raw in (None, {}, {"other_plugin": {"x": 1}}, {ADDITIONAL_CONFIG_KEY: {}}):
        cfg = AdditionalConfig.from_vllm(raw)
        assert (cfg.graph_mode, cfg.kernels, cfg.emulated_kv_cache_gb, cfg.disabled_patches) == (
            "auto",
            "auto",
            None,
            (),
        )


def test_additional_config_values() -> None:
    cfg = AdditionalConfig.from_vllm(
        {"npu": {"graph_mode": "eager", "kernels": "reference", "emulated_kv_cache_gb": 1, "disabled_patches": ["p1"]}}
    )
    assert (cfg.graph_mode, cfg.kernels, cfg.emulated_kv_cache_gb, cfg.disabled_patches) == (
        "eager",
        "reference",
        1.0,
        ("p1",),
    )


def test_additional_config_unknown_key() -> None:
    with pytest.raises(ConfigError) as info:
        AdditionalConfig.from_vllm({"npu": {"graph_mod": "eager"}})
    message = str(info.value)
    assert "--additional-config" in message
    assert "npu.graph_mod is not a known key" in message
    for known in ("npu.graph_mode", "npu.kernels", "npu.emulated_kv_cache_gb", "npu.disabled_patches"):
        assert known in message


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("graph_mode", "full", ["'auto'", "'eager'", "'piecewise'"]),
        ("kernels", "cuda", ["'auto'", "'npu'", "'reference'"]),
        ("emulated_kv_cache_gb", -3, ["(0, 1024]"]),
    ],
)
def test_additional_config_bad_value(key: str, value: object, allowed: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        AdditionalConfig.from_vllm({"npu": {key: value}})
    message = str(info.value)
    assert f"npu.{key}={value!r}" in message
    for word in allowed:
        assert word in message


def test_additional_config_section_must_be_an_object() -> None:
    with pytest.raises(ConfigError, match=r"'npu' must be an object like .*graph_mode.*got str"):
        AdditionalConfig.from_vllm({"npu": "eager"})


@pytest.mark.parametrize(
    ("model", "settings"), [(EnvConfig, ENV_SETTINGS), (AdditionalConfig, ADDITIONAL_CONFIG_SETTINGS)]
)
def test_the_schema_is_built_from_the_settings_list(model: type, settings: tuple[Setting, ...]) -> None:
    """One list of the settings: every schema field is a listed setting (and back), with its default, description
    and choices."""
    assert list(model.model_fields) == [s.key for s in settings]
    for item in settings:
        field = model.model_fields[item.key]
        assert (field.default, field.description) == (item.default, item.allowed), item.name
        choices = get_args(field.annotation)
        if item.choices:
            assert choices == item.choices, item.name
        else:
            assert not (choices and all(isinstance(c, str) for c in choices)), f"{item.name} has unlisted choices"
        assert "`" not in item.allowed  # error messages quote it


def test_setting_names_match_what_the_errors_print() -> None:
    assert [s.name for s in ENV_SETTINGS] == [ENV_PREFIX + key for key in EnvConfig.model_fields]
    assert [s.name for s in ADDITIONAL_CONFIG_SETTINGS] == [
        f"{ADDITIONAL_CONFIG_KEY}.{key}" for key in AdditionalConfig.model_fields
    ]
    with pytest.raises(ConfigError, match="npu.kernls is not a known key; known keys: npu.disabled_patches"):
        AdditionalConfig.from_vllm({ADDITIONAL_CONFIG_KEY: {"kernls": "npu"}})
    with pytest.raises(KeyError, match="no setting 'VLLM_NPU_NOPE'"):
        setting("VLLM_NPU_NOPE")
