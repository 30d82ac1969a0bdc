# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The worker LoRA manager's adapter shape check: the full sizes it expects of vLLM's LoRA-wrapped layers, and the
errors it raises (naming adapter and tensor) for every kind of mismatch. The engine-level behaviour (the refused
adapter leaves the engine serving) is in tests/e2e/test_lora_engine.py."""

from __future__ import annotations

import re

import pytest
import torch


@pytest.fixture
def ctx(vllm_ctx, tp1_group):
    return vllm_ctx


def _wrapped_modules():
    """vLLM LoRA layers over one layer of each kind, keyed as vLLM's LoRA model manager keys them."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora import utils as vlu
    from vllm.lora.layers import LogitsProcessorWithLoRA
    from vllm.model_executor.layers import linear as L
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm_npu.ops.lora.layers import from_layer_npu_first
    from vllm_npu.ops.vocab_parallel_embedding import NPUVocabParallelEmbedding

    cfg = LoRAConfig(max_lora_rank=8, max_loras=2, lora_dtype=torch.float32)
    from_layer = from_layer_npu_first(vlu.from_layer)
    layers = {
        "m.qkv_proj": (L.QKVParallelLinear(32, 8, 4, 2, bias=False), ["q_proj", "k_proj", "v_proj"]),
        "m.gate_up_proj": (L.MergedColumnParallelLinear(32, [48, 48], bias=False), ["gate_proj", "up_proj"]),
        "m.o_proj": (L.RowParallelLinear(32, 20, bias=False), []),
        "m.fc": (L.ReplicatedLinear(32, 12, bias=False), []),
        "m.embed_tokens": (NPUVocabParallelEmbedding(64, 32), []),
    }
    modules = {name: from_layer(layer, 2, cfg, packed, None) for name, (layer, packed) in layers.items()}
    head = LogitsProcessorWithLoRA(LogitsProcessor(64), 32, torch.float32, torch.device("cpu"), None)
    head.create_lora_weights(2, cfg)
    modules["lm_head"] = head
    packed = {
        "m.qkv_proj": ["m.q_proj", "m.k_proj", "m.v_proj"],
        "m.gate_up_proj": ["m.gate_proj", "m.up_proj"],
    }
    return modules, packed


def test_expected_shapes_are_the_full_sizes_of_each_slice(ctx) -> None:
    from vllm_npu.ops.lora.manager import ExpectedShape, expected_shapes

    modules, packed = _wrapped_modules()
    got = expected_shapes(modules, packed, extra_vocab=0)
    assert got == {
        "m.qkv_proj": ExpectedShape(32, 64),
        "m.q_proj": ExpectedShape(32, 32),
        "m.k_proj": ExpectedShape(32, 16),
        "m.v_proj": ExpectedShape(32, 16),
        "m.gate_up_proj": ExpectedShape(32, 96),
        "m.gate_proj": ExpectedShape(32, 48),
        "m.up_proj": ExpectedShape(32, 48),
        "m.o_proj": ExpectedShape(32, 20),
        "m.fc": ExpectedShape(32, 12),
        "m.embed_tokens": ExpectedShape(64, 32),
        "lm_head": ExpectedShape(32, None),
    }
    assert expected_shapes(modules, packed, extra_vocab=3)["m.embed_tokens"] == ExpectedShape(67, 32)


def _weights(a_shape, b_shape):
    from vllm.lora.lora_weights import LoRALayerWeights

    a = None if a_shape is None else torch.zeros(a_shape)
    b = None if b_shape is None else torch.zeros(b_shape)
    return LoRALayerWeights("x", 4, 8, a, b)


def test_matching_shapes_pass_and_unknown_modules_are_left_to_vllm() -> None:
    from vllm_npu.ops.lora.manager import ExpectedShape, check_adapter_shapes

    expected = {"m.q_proj": ExpectedShape(32, 32), "lm_head": ExpectedShape(32, None)}
    loras = {
        "m.q_proj": _weights((4, 32), (32, 4)),
        "lm_head": _weights((4, 32), (80, 4)),  # padded vocabulary: not checked
        "m.other": _weights((4, 7), (9, 4)),
    }
    check_adapter_shapes("ok", loras, expected, max_rank=8)


@pytest.mark.parametrize(
    ("a", "b", "message"),
    [
        ((4, 48), (32, 4), r"m\.q_proj lora_a is \[4, 48\], the base model needs \[4, 32\]"),
        ((4, 16), (32, 4), r"m\.q_proj lora_a is \[4, 16\], the base model needs \[4, 32\]"),
        ((4, 32), (16, 4), r"m\.q_proj lora_b is \[16, 4\], the base model needs \[32, 4\]"),
        ((4, 32), (32, 2), r"rank 4 vs 2 \(the two must agree and not exceed max_lora_rank 8\)"),
        ((16, 32), (32, 16), r"rank 16 vs 16 \(the two must agree and not exceed max_lora_rank 8\)"),
        ((4, 32, 1), (32, 4), r"both must be 2-D"),
        (None, (32, 4), r"has only lora_b"),
    ],
    ids=["wide-in", "narrow-in", "narrow-out", "ranks-differ", "rank-too-high", "3-d", "one-factor"],
)
def test_each_mismatch_names_the_adapter_and_the_tensor(a, b, message) -> None:
    from vllm_npu.ops.lora.manager import ExpectedShape, check_adapter_shapes

    with pytest.raises(ValueError, match=r"^LoRA adapter 'bad' does not match the base model: m\.q_proj ") as err:
        check_adapter_shapes("bad", {"m.q_proj": _weights(a, b)}, {"m.q_proj": ExpectedShape(32, 32)}, max_rank=8)
    assert re.search(message, str(err.value)), str(err.value)
