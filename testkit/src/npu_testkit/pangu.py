# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Tiny Pangu Pro MoE checkpoints built on the fly: ``config.json`` (``model_type`` ``"PanguProMoE"``) plus one
safetensors file with the published checkpoint's tensor names, and the demo tokenizer.

transformers has no model class for Pangu Pro MoE, so the weights are drawn here tensor by tensor (seeded) instead of
through ``from_config``; :func:`load_tensors` gives them back for a reference implementation. The config is written
as a plain dict, independent of npu-models' config class (which is what must read it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .cache import cached_build
from .models import _fingerprint, build_tokenizer, default_cache_dir

#: The tiny config: 8 experts in 2 MoGE groups (top-2, one expert per group), a shared expert, GQA 4/2 heads of
#: dim 16, two decoder layers.
PANGU_TINY: dict[str, Any] = {
    "architectures": ["PanguProMoEForCausalLM"],
    "model_type": "PanguProMoE",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "use_cache": True,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_experts_per_tok": 2,
    "num_experts": 8,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}


def pangu_tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Pangu Pro MoE checkpoint for config dict ``cfg``: name -> shape."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, e, i_moe, i_sh = (
        h // heads,
        cfg["num_experts"],
        cfg["moe_intermediate_size"],
        cfg["shared_expert_intermediate_size"],
    )
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        for proj, out in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
            shapes[f"{p}.self_attn.{proj}.weight"] = (out, h)
            shapes[f"{p}.self_attn.{proj}.bias"] = (out,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, heads * d)
        shapes[f"{p}.self_attn.o_proj.bias"] = (h,)
        shapes[f"{p}.mlp.gate.weight"] = (e, h)
        shapes[f"{p}.mlp.router_scale"] = (1, e)
        for x in range(e):
            shapes[f"{p}.mlp.experts.{x}.gate_proj.weight"] = (i_moe, h)
            shapes[f"{p}.mlp.experts.{x}.up_proj.weight"] = (i_moe, h)
            shapes[f"{p}.mlp.experts.{x}.down_proj.weight"] = (h, i_moe)
        if i_sh > 0:
            shapes[f"{p}.mlp.shared_expert.gate_proj.weight"] = (i_sh, h)
            shapes[f"{p}.mlp.shared_expert.up_proj.weight"] = (i_sh, h)
            shapes[f"{p}.mlp.shared_expert.down_proj.weight"] = (h, i_sh)
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def build_tiny_pangu(
    path: str | os.PathLike[str] | None = None, *, seed: int = 0, std: float = 0.2, **overrides: Any
) -> Path:
    """Save a random tiny Pangu Pro MoE checkpoint (:data:`PANGU_TINY` with ``overrides``) and the demo tokenizer.

    Matrices are N(0, std), norm scales U(0.5, 1.5), ``router_scale`` U(0.5, 1.5), biases N(0, std/4); float32.
    Cached by content like ``build_tiny_model``: the same config and seed is built once. Returns the directory.
    """
    tokenizer = build_tokenizer(vocab_size=512)
    cfg = {**PANGU_TINY, **overrides}
    cfg["vocab_size"] = max(cfg["vocab_size"], len(tokenizer))
    cfg.update(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    key = _fingerprint(cfg, seed, std, "pangu-safetensors-v1")
    out = Path(path) if path is not None else default_cache_dir() / f"PanguProMoE-{key}"
    return cached_build(out, key, lambda d: _write_pangu(d, cfg, tokenizer, seed, std))


def _write_pangu(out: Path, cfg: dict[str, Any], tokenizer: Any, seed: int, std: float) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in pangu_tensor_shapes(cfg).items():
        if name.endswith("norm.weight") or name.endswith("router_scale"):
            t = torch.rand(shape, generator=gen) + 0.5
        elif len(shape) >= 2:
            t = torch.randn(shape, generator=gen) * std
        else:
            t = torch.randn(shape, generator=gen) * (std / 4)
        tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tokenizer.save_pretrained(out)


def load_tensors(model_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config dict, {name: tensor})`` of a checkpoint :func:`build_tiny_pangu` wrote."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    return json.loads((model_dir / "config.json").read_text()), load_file(str(model_dir / "model.safetensors"))
