# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Tiny hybrid (linear attention + full attention) checkpoints built on the fly: Qwen3-Next.

:func:`tiny_qwen3_next_config` is a 4-layer Qwen3-Next: three gated delta-net layers then one gated full-attention
layer (partial rotary), a sparse MoE with a sigmoid-gated shared expert on every layer but one dense MLP layer, and
grouped heads in both the GDN (2 key heads, 4 value heads) and the attention (4 query heads, 2 KV heads). Build it with
``npu_testkit.models.build_tiny_model`` (cached by content, random weights, the demo tokenizer).

:func:`build_tiny_qwen3_next_mtp` adds Qwen3-Next's MTP draft layer (``mtp.*`` tensors, in a second safetensors file
that HF transformers does not read: it has no MTP module) to such a checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
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


def build_tiny_qwen3_next_mtp(config: Any, *, seed: int = 7, std: float = 0.02) -> Path:
    """The checkpoint of ``config`` (:func:`npu_testkit.models.build_tiny_model`) plus one MTP layer
    (``num_nextn_predict_layers = 1``), cached beside it.

    The draft is built to be *useful* on random weights, so that a test sees accepted drafts: ``fc`` passes the
    normed target hidden state through (identity on its second half, small noise on the embedding half), the norms
    are plain RMS norms (Gemma ``1 + w`` with ``w = 0``) and the MTP decoder layer (a gated full-attention layer with
    the target's MoE, a copy of the target's last full-attention layer's shapes) has small random weights. The
    draft's logits are then close to the target's logits of the previous position: it proposes "the last token
    again", which a tiny random model's greedy output often does. Returns the checkpoint directory."""
    from npu_testkit.cache import MARKER, cached_build
    from npu_testkit.models import build_tiny_model

    base = build_tiny_model(config)
    key = f"{(base / MARKER).read_text()}-mtp-{seed}-{std}"
    return cached_build(
        base.with_name(base.name + f"-mtp{seed}"), key, lambda d: _write_mtp(base, d, config, seed, std)
    )


def _write_mtp(base: Path, out: Path, config: Any, seed: int, std: float) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from npu_testkit.cache import MARKER

    for item in base.iterdir():
        if item.is_file() and item.name != MARKER:
            shutil.copy2(item, out / item.name)
    body = load_file(str(base / "model.safetensors"))
    hidden = config.hidden_size
    last_attn = max(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
    gen = torch.Generator().manual_seed(seed)
    dtype = body["model.embed_tokens.weight"].dtype
    prefix = f"model.layers.{last_attn}."
    mtp: dict[str, torch.Tensor] = {}
    for name, tensor in body.items():
        if name.startswith(prefix):
            noise = torch.randn(tensor.shape, generator=gen) * std
            mtp["mtp.layers.0." + name[len(prefix) :]] = (torch.zeros(tensor.shape) if "norm" in name else noise).to(
                tensor.dtype
            )
    mtp["mtp.fc.weight"] = torch.cat([torch.randn(hidden, hidden, generator=gen) * std, torch.eye(hidden)], 1).to(dtype)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = torch.zeros(hidden, dtype=dtype)
    save_file(mtp, str(out / "mtp.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
