# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""NPUModelRunner.initialize_kv_cache_tensors: several cache layers per decoder layer (DeepSeek-V3.2) bound the CUDA
way; one cache layer per index goes through vLLM's own method. Runs on a stand-in runner (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm_npu.platform.model_runner import NPUModelRunner

V32_LAYERS = [
    "model.layers.0.self_attn.attn",
    "model.layers.0.self_attn.indexer.k_cache",
    "model.layers.1.self_attn.attn",
    "model.layers.1.self_attn.indexer.k_cache",
]


def fake_runner(layer_names: list[str], shared: dict[str, str] | None = None) -> SimpleNamespace:
    caches = {name: torch.full((2, 4), float(i)) for i, name in enumerate(layer_names)}
    runner = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v32")),
        shared_kv_cache_layers=shared or {},
        compilation_config=SimpleNamespace(
            static_forward_context={
                n: SimpleNamespace(kv_cache=[torch.tensor([])]) for n in [*layer_names, *(shared or {})]
            }
        ),
        kv_caches=[],
        _allocate_kv_cache_tensors=lambda config: "raw",
        _reshape_kv_cache_tensors=lambda config, raw: dict(caches),
    )
    runner._num_attn_module = lambda: NPUModelRunner._num_attn_module(runner)
    runner._cache_layers_share_an_index = lambda config: NPUModelRunner._cache_layers_share_an_index(runner, config)
    return runner


def kv_config(layer_names: list[str]) -> SimpleNamespace:
    return SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(layer_names=[n for n in layer_names if n.endswith("attn")]),
            SimpleNamespace(layer_names=[n for n in layer_names if n.endswith("k_cache")]),
        ]
    )


def test_two_cache_layers_per_decoder_layer_are_all_bound():
    runner = fake_runner(V32_LAYERS)
    kv = NPUModelRunner.initialize_kv_cache_tensors(runner, kv_config(V32_LAYERS))
    assert list(kv) == V32_LAYERS
    ctx = runner.compilation_config.static_forward_context
    for name in V32_LAYERS:
        assert ctx[name].kv_cache[0] is kv[name]
    # The runner's list keeps the first cache of each layer index, in index order (vLLM's CUDA behaviour).
    assert [id(t) for t in runner.kv_caches] == [
        id(kv["model.layers.0.self_attn.attn"]),
        id(kv["model.layers.1.self_attn.attn"]),
    ]


def test_shared_layer_reuses_its_target_cache():
    names = V32_LAYERS[:2]
    runner = fake_runner(names, shared={"model.layers.1.self_attn.attn": "model.layers.0.self_attn.attn"})
    kv = NPUModelRunner.initialize_kv_cache_tensors(runner, kv_config(names))
    assert kv["model.layers.1.self_attn.attn"] is kv["model.layers.0.self_attn.attn"]
    assert len(runner.kv_caches) == 2


def test_one_cache_layer_per_index_is_vllms_path():
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert not NPUModelRunner._cache_layers_share_an_index(fake_runner(names), kv_config(names))
    assert NPUModelRunner._cache_layers_share_an_index(fake_runner(V32_LAYERS), kv_config(V32_LAYERS))
