# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Layer-level tests of the Qwen VL vision overrides: a vLLM vision tower converted by ``adopt_vision_attention``
(and padded by ``pad_vision_heads``) gives vLLM's own tower output, over a batch of two images and a 2-frame video
(so several sequences, window and full attention for Qwen2.5-VL), at head dims 16 (never padded) and 80 (padded to
128 like the released Qwen2/2.5-VL towers); the registry maps the four architectures to our classes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_npu.interface import ConfigError, configure_kernels  # noqa: E402

# (t, h, w) patch grids: two images of different sizes and a two-temporal-patch video.
GRID = [[1, 4, 6], [1, 8, 4], [2, 4, 4]]


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    configure_kernels("reference")


def _tower(arch: str, head_dim: int):
    import transformers

    if arch == "qwen2_vl":
        from vllm.model_executor.models.qwen2_vl import Qwen2VisionTransformer

        cfg = transformers.Qwen2VLConfig(
            vision_config={
                "depth": 2,
                "embed_dim": 2 * head_dim,
                "hidden_size": 48,
                "mlp_ratio": 2,
                "num_heads": 2,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            }
        ).vision_config
        return Qwen2VisionTransformer(cfg), cfg
    if arch == "qwen2_5_vl":
        from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionTransformer

        cfg = transformers.Qwen2_5_VLConfig(
            vision_config={
                "depth": 3,
                "hidden_size": 2 * head_dim,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 48,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 56,
                "fullatt_block_indexes": [1],
            }
        ).vision_config
        return Qwen2_5_VisionTransformer(cfg), cfg
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    cfg = transformers.Qwen3VLConfig(
        vision_config={
            "depth": 2,
            "hidden_size": 2 * head_dim,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 48,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        }
    ).vision_config
    return Qwen3_VisionTransformer(cfg), cfg


def _randomise(tower: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _pixels(cfg, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in GRID)
    return torch.randn(rows, 3 * cfg.temporal_patch_size * cfg.patch_size**2, generator=gen)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("head_dim", [16, 80])
def test_converted_tower_matches_vllm(tp1_group, arch: str, head_dim: int) -> None:
    from vllm_npu.models.vision import (
        AscendQwen2_5_VisionAttention,
        AscendQwen2VisionAttention,
        adopt_vision_attention,
        pad_vision_heads,
    )

    tower, cfg = _tower(arch, head_dim)
    ours, _ = _tower(arch, head_dim)
    _randomise(tower)
    _randomise(ours)  # the same weights (vLLM's parameters do not deep-copy)
    pad = arch != "qwen3_vl"  # what the model overrides ask for (vllm-ascend v0.11.0's choice)
    assert adopt_vision_attention(ours, pad_head_dim=pad) == cfg.depth
    padded = pad_vision_heads(ours)
    assert padded == (cfg.depth if pad and head_dim == 80 else 0)
    assert pad_vision_heads(ours) == 0  # once only
    expected_cls = AscendQwen2VisionAttention if arch == "qwen2_vl" else AscendQwen2_5_VisionAttention
    for block in ours.blocks:
        assert type(block.attn) is expected_cls
        width = 128 if padded else head_dim
        assert block.attn.npu_head_dim == width and block.attn.npu_scale == head_dim**-0.5
        assert block.attn.qkv.weight.shape[0] == 3 * 2 * width
        assert block.attn.proj.weight.shape[1] == 2 * width

    x = _pixels(cfg)
    with torch.no_grad():
        want = tower(x, grid_thw=GRID)
        got = ours(x, grid_thw=GRID)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    attn = ours.blocks[0].attn
    assert [b.attn.npu_calls for b in ours.blocks] == [1] * cfg.depth
    # cos/sin once per tower forward; host lengths once per distinct cu_seqlens (window + full for Qwen2.5-VL)
    assert attn.npu_cos_sin.computed == 1
    assert attn.npu_seq_lens.computed == (2 if arch == "qwen2_5_vl" else 1)


def test_padding_is_skipped_for_quantised_or_split_attention(tp1_group) -> None:
    from vllm_npu.models.vision import adopt_vision_attention, pad_vision_heads

    tower, _ = _tower("qwen2_vl", 80)
    adopt_vision_attention(tower, pad_head_dim=True)
    tower.blocks[0].attn.tp_size = 2  # as if the heads were split over two ranks
    tower.blocks[1].attn.proj.quant_method = object()  # as if quantised
    assert pad_vision_heads(tower) == 0
    assert all(b.attn.npu_head_dim == 80 for b in tower.blocks)


def test_an_unknown_attention_class_is_refused(tp1_group) -> None:
    from vllm_npu.models.vision import adopt_vision_attention

    tower, _ = _tower("qwen2_vl", 16)
    tower.blocks[1].attn = torch.nn.Identity()
    with pytest.raises(ConfigError, match="no NPU vision attention for torch.nn.modules.linear.Identity"):
        adopt_vision_attention(tower, pad_head_dim=False)


def test_the_registry_maps_the_qwen_vl_architectures_to_the_overrides() -> None:
    from vllm import ModelRegistry
    from vllm_npu.models._hooks import MODEL_OVERRIDES, register_models

    register_models()
    for arch in (
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
    ):
        entry = ModelRegistry.models[arch]
        assert (
            f"{entry.module_name}:{entry.class_name}"
            == MODEL_OVERRIDES[arch]
            == f"vllm_npu.models.qwen_vl:Ascend{arch}"
        )
