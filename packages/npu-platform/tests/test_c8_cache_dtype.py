# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A C8 checkpoint (either spelling) gets vLLM's int8 KV cache from the platform; other checkpoints keep theirs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm_npu.interface import ConfigError
from vllm_npu.platform.platform import NPUPlatform


def _config(model_dir: Path, description: dict, quantization: str | None = "ascend", cache_dtype: str = "auto"):
    (model_dir / "quant_model_description.json").write_text(json.dumps(description))
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(model_dir), quantization=quantization, hf_config=SimpleNamespace()),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
    )


BASE = {"model.layers.0.self_attn.k_proj.weight": "W8A8_DYNAMIC"}


@pytest.mark.parametrize("key", ["kv_quant_type", "kv_cache_type"])
def test_c8_checkpoints_get_an_int8_cache(tmp_path: Path, key: str) -> None:
    config = _config(tmp_path, {**BASE, key: "C8"})
    NPUPlatform._int8_kv_cache_for_c8(config)
    assert config.cache_config.cache_dtype == "int8"


@pytest.mark.parametrize(("description", "quantization"), [(BASE, "ascend"), ({**BASE, "kv_quant_type": "C8"}, None)])
def test_other_checkpoints_keep_their_cache(tmp_path: Path, description: dict, quantization: str | None) -> None:
    config = _config(tmp_path, description, quantization)
    NPUPlatform._int8_kv_cache_for_c8(config)
    assert config.cache_config.cache_dtype == "auto"


def test_an_fp8_cache_choice_conflicts_with_c8(tmp_path: Path) -> None:
    config = _config(tmp_path, {**BASE, "kv_cache_type": "C8"}, cache_dtype="fp8")
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8 conflicts with this C8 checkpoint"):
        NPUPlatform._int8_kv_cache_for_c8(config)
