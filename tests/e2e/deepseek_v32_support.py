# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Tiny DeepSeek-V3.2 checkpoints for the e2e tests (transformers has no V3.2 model class).

:func:`build_v32_pair` builds a dense DeepSeek-V3 checkpoint with random weights (``npu_testkit.models``) and, next
to it, a V3.2 checkpoint with the same weights plus random lightning-indexer weights, named as vLLM 0.11's
``DeepseekV2ForCausalLM.load_weights`` expects (``model.layers.<i>.self_attn.indexer.{wq_b,wk,k_norm,
weights_proj}``), and ``config.json`` with ``architectures=["DeepseekV32ForCausalLM"]`` and the index keys.

The sparse reference (no vLLM, no plugin code): :func:`indexer_topk_reference` is the lightning-indexer selection
written from vLLM 0.11's ``Indexer`` math in float64 (all scores, causal, top-k), and :func:`sparse_hf_greedy` runs
HF transformers' dense DeepSeek-V3 on the same weights with every layer's attention restricted to the tokens that
layer's indexer selects (full recompute per generated token, eager attention).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

#: Indexer shape of the tiny model (the real V3.2: 64 heads of 128, rope dim = qk_rope_head_dim).
INDEX_N_HEADS = 16
INDEX_HEAD_DIM = 16


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
    from npu_testkit.cache import cached_build
    from npu_testkit.engine import tiny_config
    from npu_testkit.models import build_tiny_model
    from safetensors.torch import load_file, save_file

    dense = build_tiny_model(tiny_config("deepseek_v3"), seed=seed)
    out = dense.with_name(f"{dense.name}-v32-topk{index_topk}-h{INDEX_N_HEADS}d{INDEX_HEAD_DIM}")

    def write(staging: Path) -> None:
        tensors: dict[str, Any] = {}
        for f in sorted(dense.glob("*.safetensors")):
            tensors.update(load_file(f))
        for f in dense.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", ".complete"):
                shutil.copy(f, staging / f.name)
        (staging / "model.safetensors.index.json").unlink(missing_ok=True)
        cfg = json.loads((dense / "config.json").read_text())
        cfg.update(
            architectures=["DeepseekV32ForCausalLM"],
            index_topk=index_topk,
            index_n_heads=INDEX_N_HEADS,
            index_head_dim=INDEX_HEAD_DIM,
        )
        (staging / "config.json").write_text(json.dumps(cfg, indent=2))
        tensors.update(indexer_weights(tiny_config("deepseek_v3"), seed=seed + 1))
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(staging / "model.safetensors"),
            metadata={"format": "pt"},
        )

    return cached_build(out, f"v32-{dense.name}-{seed + 1}", write), dense


def gptj_rope(x, positions, theta: float):
    """GPT-J (interleaved pairs) rotary embedding of ``x [T, ..., R]`` at ``positions [T]``, float64."""
    import torch

    r = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    ang = positions.double()[:, None] * inv_freq[None, :]  # [T, R/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def indexer_topk_reference(w: dict[str, Any], layer: int, hidden, q_c, topk: int, theta: float, rope_dim: int):
    """Per token, the set of positions (``<=`` its own) the layer's lightning indexer keeps (``topk`` best scores).

    ``w``: the checkpoint's tensors; ``hidden [T, hidden_size]`` the layer's attention input (after the input norm);
    ``q_c [T, q_lora_rank]`` (after ``q_a_layernorm``). score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]) with
    ``w = weights_proj(x) * D**-0.5 * H**-0.5``, ``k = LayerNorm(wk(x))``, rope on the first ``rope_dim`` channels.
    Returns ``(selected, scores)``: a list of sets and the ``[T, T]`` float64 scores (-inf above the diagonal).
    """
    import torch

    p = f"model.layers.{layer}.self_attn.indexer"
    h, q_c = hidden.double(), q_c.double()
    T = h.shape[0]
    H, D = INDEX_N_HEADS, INDEX_HEAD_DIM
    pos = torch.arange(T)
    q = (q_c @ w[f"{p}.wq_b.weight"].double().T).view(T, H, D)
    k = torch.nn.functional.layer_norm(
        h @ w[f"{p}.wk.weight"].double().T, (D,), w[f"{p}.k_norm.weight"].double(), w[f"{p}.k_norm.bias"].double(), 1e-6
    )
    q = torch.cat([gptj_rope(q[..., :rope_dim], pos, theta), q[..., rope_dim:]], -1)
    k = torch.cat([gptj_rope(k[:, :rope_dim], pos, theta), k[:, rope_dim:]], -1)
    weights = (h @ w[f"{p}.weights_proj.weight"].double().T + w[f"{p}.weights_proj.bias"].double()) * D**-0.5 * H**-0.5
    scores = (torch.einsum("thd,sd->ths", q, k).relu() * weights[:, :, None]).sum(1)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    selected = [set(torch.topk(scores[t], min(topk, t + 1)).indices.tolist()) for t in range(T)]
    return selected, scores


class SparseHFReference:
    """HF DeepSeek-V3 (dense checkpoint, eager attention) whose layers attend only to the reference selection."""

    def __init__(self, dense_dir, v32_dir, topk: int) -> None:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32, attn_implementation="eager")
        self.model.eval()
        self.w = load_file(str(v32_dir / "model.safetensors"))
        self.topk = topk
        self.selections: dict[int, list[set[int]]] = {}
        cfg = self.model.config
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.register_forward_pre_hook(
                self._hook(i, cfg.rope_theta, cfg.qk_rope_head_dim), with_kwargs=True
            )

    def _hook(self, i: int, theta: float, rope_dim: int):
        import torch

        def pre_hook(module, args, kwargs):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            q_c = module.q_a_layernorm(module.q_a_proj(x))
            selected, _ = indexer_topk_reference(self.w, i, x[0], q_c[0], self.topk, theta, rope_dim)
            self.selections[i] = selected
            T = x.shape[1]
            mask = torch.full((T, T), float("-inf"), dtype=x.dtype)
            for t, chosen in enumerate(selected):
                mask[t, sorted(chosen)] = 0.0
            kwargs["attention_mask"] = mask[None, None]
            return args, kwargs

        return pre_hook

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        import torch

        out = []
        with torch.no_grad():
            for ids in prompts:
                seq = list(ids)
                for _ in range(max_new_tokens):
                    logits = self.model(torch.tensor([seq]), use_cache=False).logits[0, -1]
                    seq.append(int(logits.argmax()))
                out.append(seq[len(ids) :])
        return out
