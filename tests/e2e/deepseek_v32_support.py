"""Tiny DeepSeek-V3.2 checkpoints for the e2e tests (transformers has no V3.2 model class).

:func:`build_v32_pair` builds a dense DeepSeek-V3 checkpoint with random weights (``npu_testkit.models``) and, next
to it, a V3.2 checkpoint with the same weights plus random lightning-indexer weights, named as vLLM 0.11's
``DeepseekV2ForCausalLM.load_weights`` expects (``model.layers.<i>.self_attn.indexer.{wq_b,wk,k_norm,
weights_proj}``), and ``config.json`` with ``architectures=["DeepseekV32ForCausalLM"]`` and the index keys.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

#: Indexer shape of the tiny model (the real V3.2: 64 heads of 128, rope dim = qk_rope_head_dim).
INDEX_N_HEADS = 4
INDEX_HEAD_DIM = 16


def tiny_deepseek_v3(**overrides: Any):
    import transformers

    fields: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,  # layer 0 dense MLP, layer 1 MoE (vLLM's DeepSeek needs one MoE layer)
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return transformers.DeepseekV3Config(**fields)


def indexer_weights(config: Any, *, seed: int, std: float = 0.2) -> dict[str, Any]:
    """Random indexer weights of every layer, keyed by their checkpoint names."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, d, hid, ql = INDEX_N_HEADS, INDEX_HEAD_DIM, config.hidden_size, config.q_lora_rank
    out = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn.indexer"
        out[f"{p}.wq_b.weight"] = torch.randn(h * d, ql, generator=g) * std
        out[f"{p}.wk.weight"] = torch.randn(d, hid, generator=g) * std
        out[f"{p}.k_norm.weight"] = torch.rand(d, generator=g) + 0.5
        out[f"{p}.k_norm.bias"] = torch.randn(d, generator=g) * std / 4
        out[f"{p}.weights_proj.weight"] = torch.randn(h, hid, generator=g) * std
        out[f"{p}.weights_proj.bias"] = torch.randn(h, generator=g) * std / 4
    return out


def build_v32_pair(index_topk: int, *, seed: int = 0) -> tuple[Path, Path]:
    """``(v32_dir, dense_dir)``: the V3.2 checkpoint and the dense V3 checkpoint with the same non-indexer weights.
    Cached like ``build_tiny_model`` (the V3.2 dir sits next to the dense one, keyed by ``index_topk``)."""
    from npu_testkit.models import build_tiny_model
    from safetensors.torch import load_file, save_file

    dense = build_tiny_model(tiny_deepseek_v3(), seed=seed)
    out = dense.with_name(f"{dense.name}-v32-topk{index_topk}-h{INDEX_N_HEADS}d{INDEX_HEAD_DIM}")
    marker = out / ".complete"
    if marker.exists():
        return out, dense
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Any] = {}
    for f in sorted(dense.glob("*.safetensors")):
        tensors.update(load_file(f))
    for f in dense.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", ".complete"):
            shutil.copy(f, out / f.name)
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    cfg = json.loads((dense / "config.json").read_text())
    cfg.update(
        architectures=["DeepseekV32ForCausalLM"],
        index_topk=index_topk,
        index_n_heads=INDEX_N_HEADS,
        index_head_dim=INDEX_HEAD_DIM,
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors.update(indexer_weights(tiny_deepseek_v3(), seed=seed + 1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    marker.write_text("ok")
    return out, dense
