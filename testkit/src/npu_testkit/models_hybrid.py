# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Tiny hybrid (linear attention + full attention) checkpoints built on the fly: Qwen3-Next.

:func:`tiny_qwen3_next_config` is a 4-layer Qwen3-Next: three gated delta-net layers then one gated full-attention
layer (partial rotary), a sparse MoE with a sigmoid-gated shared expert on every layer but one dense MLP layer, and
grouped heads in both the GDN (2 key heads, 4 value heads) and the attention (4 query heads, 2 KV heads). Build it with
``npu_testkit.models.build_tiny_model`` (cached by content, random weights, the demo tokenizer).
"""

from __future__ import annotations

from typing import Any


def tiny_qwen3_next_config(**overrides: Any) -> Any:
    """A ``transformers.Qwen3NextConfig`` small enough for CPU engines; keyword arguments override fields."""
    from transformers import Qwen3NextConfig

    fields: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "intermediate_size": 96,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    fields.update(overrides)
    return Qwen3NextConfig(**fields)
