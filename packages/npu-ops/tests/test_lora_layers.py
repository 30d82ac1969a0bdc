# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The LoRA layer classes for our layer classes, the ``from_layer`` wrapper of the ``lora-npu-layers`` patch, and
``PunicaWrapperNPU`` against vLLM's ``PunicaWrapperCPU`` (the torch-ops wrapper) on real LoRA layers."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def ctx(vllm_ctx, tp1_group):
    return vllm_ctx


def _cfg(fully_sharded: bool = False, rank: int = 8):
    from vllm.config.lora import LoRAConfig

    return LoRAConfig(max_lora_rank=rank, max_loras=3, fully_sharded_loras=fully_sharded, lora_dtype=torch.float32)


def _layers():
    from vllm.model_executor.layers import linear as L
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return {
        "column": (L.ColumnParallelLinear(32, 24, bias=False), []),
        "merged2": (L.MergedColumnParallelLinear(32, [16, 16], bias=False), ["gate_proj", "up_proj"]),
        "qkv3": (L.QKVParallelLinear(32, 8, 4, 2, bias=False), ["q_proj", "k_proj", "v_proj"]),
        "row": (L.RowParallelLinear(32, 20, bias=False), []),
        "replicated": (L.ReplicatedLinear(32, 12, bias=False), []),
        "embedding": (VocabParallelEmbedding(64, 32), []),
        "lm_head": (ParallelLMHead(64, 32), []),
    }


#: Which LoRA class wraps each layer (None: left unwrapped, as vLLM leaves the LM head; its logits processor is
#: wrapped instead).
EXPECTED = {
    "column": "ColumnParallelLinearWithLoRA",
    "merged2": "MergedColumnParallelLinearWithLoRA",
    "qkv3": "MergedQKVParallelLinearWithLoRA",
    "row": "RowParallelLinearWithLoRA",
    "replicated": "ReplicatedLinearWithLoRA",
    "embedding": "NPUVocabParallelEmbeddingWithLoRA",
    "lm_head": None,
}


def test_from_layer_with_the_patch_wraps_every_layer_the_ops_layer_builds(ctx) -> None:
    from vllm.lora import utils as vlu
    from vllm_npu.ops.lora.layers import from_layer_npu_first

    from_layer = from_layer_npu_first(vlu.from_layer)
    for name, (layer, packed) in _layers().items():
        wrapped = from_layer(layer, 3, _cfg(), packed, None)
        assert (type(wrapped).__name__ if wrapped is not layer else None) == EXPECTED[name], name
        if wrapped is not layer:
            assert wrapped.base_layer is layer


def test_vllm_alone_does_not_wrap_our_embedding(ctx) -> None:
    # vLLM's LoRA classes test the exact type: the reason for the lora-npu-layers patch
    from vllm.lora import utils as vlu

    layer, _ = _layers()["embedding"]
    assert type(layer).__name__ == "NPUVocabParallelEmbedding"
    assert vlu.from_layer(layer, 3, _cfg(), [], None) is layer


def test_npu_class_leaves_vllm_layers_to_vllm(ctx) -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm_npu.ops.lora.layers import npu_lora_class

    layer = object.__new__(VocabParallelEmbedding)  # vLLM's exact class (CustomOp.__new__ would build ours)
    assert npu_lora_class(layer, _cfg(), []) is None
    layer, packed = _layers()["qkv3"]
    assert npu_lora_class(layer, _cfg(), packed) is None


def test_from_layer_wrapper_delegates_everything_else(ctx) -> None:
    from vllm_npu.ops.lora.layers import WRAPPER_FLAG, from_layer_npu_first

    seen = []

    def original(layer, max_loras, lora_config, packed, model_config=None):
        seen.append(layer)
        return layer

    from_layer = from_layer_npu_first(original)
    assert getattr(from_layer, WRAPPER_FLAG) is True and from_layer.__wrapped__ is original
    layer, _ = _layers()["embedding"]
    wrapped = from_layer(layer, 3, _cfg(), [], None)
    assert type(wrapped).__name__ == "NPUVocabParallelEmbeddingWithLoRA" and seen == []
    assert wrapped.lora_a_stacked.shape == (3, 64 + 256, 8)  # org vocab + vLLM's default extra vocab, max rank
    other = torch.nn.Linear(2, 2)
    assert from_layer(other, 3, _cfg(), [], None) is other and seen == [other]


def test_missing_patch_is_a_clear_error(monkeypatch) -> None:
    from vllm.lora import models
    from vllm_npu.interface import ConfigError
    from vllm_npu.ops.lora.layers import check_npu_lora_layers

    monkeypatch.setattr(models, "from_layer", lambda *a, **k: None)
    with pytest.raises(ConfigError, match="lora-npu-layers.*not applied.*VLLM_NPU_PATCHES"):
        check_npu_lora_layers()


def _wrappers(monkeypatch, mapping, lora_index_to_id, max_loras):
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm_npu.ops.lora import layers as lora_layers
    from vllm_npu.ops.lora.punica import PunicaWrapperNPU

    monkeypatch.setattr(lora_layers, "check_npu_lora_layers", lambda: None)
    ours = PunicaWrapperNPU(64, 8, "cpu", max_loras=max_loras)
    theirs = PunicaWrapperCPU(64, 8, "cpu", max_loras=max_loras)
    for w in (ours, theirs):
        # vLLM's manager passes lora_slots + 1 as max_loras
        w.update_metadata(mapping, lora_index_to_id, max_loras + 1, 64, 0)
    return ours, theirs


@pytest.mark.parametrize("is_prefill", [True, False])
def test_punica_wrapper_matches_vllm_cpu_wrapper_on_a_qkv_lora_layer(ctx, monkeypatch, is_prefill: bool) -> None:
    from vllm.lora.layers import LoRAMapping, MergedQKVParallelLinearWithLoRA

    layer, _ = _layers()["qkv3"]
    lora = MergedQKVParallelLinearWithLoRA(layer)
    lora.create_lora_weights(3, _cfg())
    gen = torch.Generator().manual_seed(0)
    # slots 0 and 1 hold adapters 7 and 9 of ranks 8 and 4; slot 2 stays empty, so vLLM's slot -1 reads zeros
    for slot, rank in ((0, 8), (1, 4)):
        for i, out in enumerate(lora.output_slices):
            lora.lora_a_stacked[i][slot, 0, :rank] = torch.randn(rank, 32, generator=gen)
            lora.lora_b_stacked[i][slot, 0, :, :rank] = torch.randn(out, rank, generator=gen)
    # tokens: 3 of adapter 7, 2 of none, 1 of adapter 9, 2 of adapter 7
    mapping = LoRAMapping((7, 7, 7, 0, 0, 9, 7, 7), (7, 0, 9, 7), is_prefill=is_prefill)
    ours, theirs = _wrappers(monkeypatch, mapping, [7, 9, None], 3)
    x = torch.randn(8, 32, generator=gen)
    base = torch.randn(8, sum(lora.output_slices), generator=gen)
    got, expect = base.clone(), base.clone()
    args = (lora.lora_a_stacked, lora.lora_b_stacked, None, 0.5, lora.output_slices)
    ours.add_lora_linear(got, x, *args)
    theirs.add_lora_linear(expect, x, *args)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[:3], base[:3]) and torch.equal(got[3:5], base[3:5])

    # logits: one row per request (sampler mapping)
    a = torch.randn(3, 1, 8, 32, generator=gen)
    a[2] = 0
    b = torch.randn(3, 1, 50, 8, generator=gen)
    b[2] = 0
    h, y0 = torch.randn(4, 32, generator=gen), torch.randn(4, 50, generator=gen)
    got, expect = y0.clone(), y0.clone()
    ours.add_lora_logits(got, h, a, b, 1.0)
    theirs.add_lora_logits(expect, h, a, b, 1.0)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_punica_wrapper_launches_nothing_without_lora(ctx, monkeypatch) -> None:
    from vllm.lora.layers import LoRAMapping

    ours, _ = _wrappers(monkeypatch, LoRAMapping((0, 0, 0), (0,), is_prefill=True), [7, None, None], 3)

    def boom(*args, **kwargs):
        raise AssertionError("no kernel may run for a batch without LoRA")

    for name in ("_sgmv_shrink", "_sgmv_expand", "_bgmv_shrink", "_bgmv_expand"):
        monkeypatch.setattr(ours, name, boom)
    y = torch.randn(3, 16)
    before = y.clone()
    w = (torch.randn(3, 1, 8, 4),)
    ours.add_lora_linear(y, torch.randn(3, 4), w, (torch.randn(3, 1, 16, 8),), None, 1.0, (16,))
    buf = (torch.ones(3, 8),)
    ours.add_shrink(buf, torch.randn(3, 4), w, 1.0)
    assert torch.equal(y, before) and torch.equal(buf[0], torch.zeros(3, 8))


def test_platform_names_the_wrapper() -> None:
    from vllm.utils import resolve_obj_by_qualname
    from vllm_npu.ops.lora.punica import PunicaWrapperNPU, PunicaWrapperNPUWithBias
    from vllm_npu.platform.platform import NPUPlatform

    qualname = NPUPlatform.get_punica_wrapper()
    assert resolve_obj_by_qualname(qualname) is PunicaWrapperNPU
    assert PunicaWrapperNPU is PunicaWrapperNPUWithBias  # vLLM 0.11.0's wrapper API (LoRA bias)


def test_the_bias_free_api_of_vllm_0_11_1_runs_the_same_kernels(ctx, monkeypatch) -> None:
    """vLLM 0.11.1 dropped LoRA bias: its layers call add_lora_linear(y, x, A, B, scale, slices) and
    add_expand(y, x, B, slices, offset) positionally. The 0.11.1 variant gives what the 0.11.0 one gives without
    bias."""
    from vllm.lora.layers import LoRAMapping
    from vllm_npu.ops.lora import layers as lora_layers
    from vllm_npu.ops.lora.punica import PunicaWrapperNPUNoBias, PunicaWrapperNPUWithBias

    monkeypatch.setattr(lora_layers, "check_npu_lora_layers", lambda: None)
    mapping = LoRAMapping((7, 7, 0, 9), (7, 0, 9), is_prefill=True)
    old, new = PunicaWrapperNPUWithBias(64, 8, "cpu", max_loras=3), PunicaWrapperNPUNoBias(64, 8, "cpu", max_loras=3)
    for w in (old, new):
        w.update_metadata(mapping, [7, 9, None], 4, 64, 0)
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(3, 1, 8, 4, generator=gen), torch.randn(3, 1, 8, 4, generator=gen))
    b = (torch.randn(3, 1, 16, 8, generator=gen), torch.randn(3, 1, 6, 8, generator=gen))
    x, y0 = torch.randn(4, 4, generator=gen), torch.randn(4, 22, generator=gen)
    got, expect = y0.clone(), y0.clone()
    new.add_lora_linear(got, x, a, b, 0.5, (16, 6))
    old.add_lora_linear(expect, x, a, b, None, 0.5, (16, 6))
    torch.testing.assert_close(got, expect)
    assert not torch.equal(got, y0)
    buffers = tuple(torch.randn(4, 8, generator=gen) for _ in range(2))
    got, expect = y0.clone(), y0.clone()
    new.add_expand(got, buffers, b, (16, 6), 0)
    old.add_expand(expect, buffers, b, None, (16, 6), 0)
    torch.testing.assert_close(got, expect)


def test_padded_rows_past_the_mapping_get_no_lora(ctx, monkeypatch) -> None:
    from vllm.lora.layers import LoRAMapping

    ours, _ = _wrappers(monkeypatch, LoRAMapping((7, 7), (7,), is_prefill=True), [7, None, None], 3)
    a, b = (torch.randn(3, 1, 8, 4),), (torch.randn(3, 1, 16, 8),)
    x, y = torch.randn(5, 4), torch.zeros(5, 16)  # 3 padding rows (graph padding)
    ours.add_lora_linear(y, x, a, b, None, 1.0, (16,))
    torch.testing.assert_close(y[:2], x[:2] @ a[0][0, 0].t() @ b[0][0, 0].t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(y[2:], torch.zeros(3, 16))
    with pytest.raises(ValueError, match="got 1 tokens but the batch's LoRA mapping has 2"):
        ours.add_lora_linear(torch.zeros(1, 16), torch.randn(1, 4), a, b, None, 1.0, (16,))


def test_wrapper_refuses_to_be_compiled_into_a_graph(ctx, monkeypatch) -> None:
    from vllm.lora.layers import LoRAMapping
    from vllm_npu.interface import ConfigError

    ours, _ = _wrappers(monkeypatch, LoRAMapping((7,), (7,), is_prefill=True), [7, None, None], 3)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ConfigError, match="--enforce-eager"):
        ours.add_lora_linear(
            torch.zeros(1, 16),
            torch.randn(1, 4),
            (torch.randn(3, 1, 8, 4),),
            (torch.randn(3, 1, 16, 8),),
            None,
            1.0,
            (16,),
        )
