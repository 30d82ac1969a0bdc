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


@pytest.mark.parametrize("emulated", [True, False])
def test_torchair_refuses_the_int8_cache_on_every_device(emulated: bool) -> None:
    import torch
    from vllm.config.compilation import CompilationConfig
    from vllm_npu.platform.graphs.config import configure_graphs

    cfg = SimpleNamespace(  # the parts of a VllmConfig the graph config reads (a dense GQA model)
        compilation_config=CompilationConfig(cudagraph_mode=None, cudagraph_capture_sizes=[1, 2, 4]),
        model_config=SimpleNamespace(
            enforce_eager=False,
            get_num_layers=lambda parallel: 2,
            use_mla=False,
            hf_config=SimpleNamespace(),
            hf_text_config=SimpleNamespace(num_experts=0),
            model="/nonexistent",
            quantization=None,
            dtype=torch.bfloat16,
        ),  # fmt: skip
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, data_parallel_size=1, enable_expert_parallel=False, enable_eplb=False
        ),
        additional_config=None,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
        speculative_config=None,
        kv_transfer_config=None,
        cache_config=SimpleNamespace(cache_dtype="int8"),  # what the platform sets for a C8 checkpoint
    )
    with pytest.raises(ConfigError, match=r"'torchair' does not run an int8 KV cache \(C8 checkpoint\)"):
        configure_graphs(cfg, "torchair", emulated=emulated)
    cfg.cache_config.cache_dtype = "auto"
    assert configure_graphs(cfg, "torchair", emulated=emulated).mode == "FULL_DECODE_ONLY"
