# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Draft checkpoints for speculative decoding, built on the fly in vLLM 0.11's expected weight layouts.

- :func:`build_eagle_head`: an EAGLE-1 head (``method="eagle"``: ``fc [H, 2H]`` over ``cat(embed, hidden)``, one
  Llama decoder layer ``layers.0.*`` without its input norm; embedding and LM head shared with the target) or an
  EAGLE-3 head (``method="eagle3"``: ``fc [H, 3H]`` over three of the target's hidden states, ``midlayer.*`` whose
  attention projections read ``2H``, ``hidden_norm``, ``norm``, its own ``lm_head`` over a reduced draft vocabulary
  and ``d2t`` draft-to-target offsets), as in the published EAGLE / EAGLE-3 checkpoints.
- :func:`train_eagle_head`: an EAGLE-1 head trained for a few hundred steps on the target's own greedy outputs
  (teacher forcing, plain PyTorch on the target's HF modules), so that its drafts are often accepted.
- :func:`build_mtp_model`: a DeepSeek-V3 checkpoint with ``num_nextn_predict_layers=1``: the target's layers plus
  one multi-token-prediction layer ``model.layers.<num_hidden_layers>.*`` (``enorm``, ``hnorm``, ``eh_proj``,
  ``shared_head.{norm,head}``, ``embed_tokens`` and a full decoder layer), as DeepSeek ships it. HF transformers
  ignores the extra layer, so the HF reference of the target is unchanged.

Everything is cached by content under :func:`~.models.default_cache_dir` through :func:`.cache.cached_build` (a
``.complete`` marker holds the key).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cache import cached_build
from .models import build_tokenizer, default_cache_dir, write_random_checkpoint

_MTP_SPECIFIC = ("enorm", "hnorm", "eh_proj", "shared_head")


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _target_key(target_dir: Path) -> str:
    marker = target_dir / ".complete"
    return marker.read_text() if marker.exists() else str(target_dir.resolve())


def _head_config(target_dir: Path, method: str, draft_vocab_size: int | None) -> Any:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(target_dir)
    if cfg.model_type != "llama":
        raise ValueError(f"build_eagle_head: the tiny heads follow vLLM's Llama EAGLE models; got {cfg.model_type!r}")
    cfg.num_hidden_layers = 1
    if method == "eagle":
        cfg.architectures = ["LlamaForCausalLM"]  # vLLM's EAGLEConfig maps it to EagleLlamaForCausalLM
    else:
        cfg.architectures = ["LlamaForCausalLMEagle3"]
        cfg.draft_vocab_size = draft_vocab_size or cfg.vocab_size
    return cfg


def _layer_weights(prefix: str, cfg: Any, attn_in: int, rand: Any) -> dict[str, Any]:
    import torch

    H, inter = cfg.hidden_size, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or H // nh
    return {
        f"{prefix}self_attn.q_proj.weight": rand(nh * hd, attn_in),
        f"{prefix}self_attn.k_proj.weight": rand(nkv * hd, attn_in),
        f"{prefix}self_attn.v_proj.weight": rand(nkv * hd, attn_in),
        f"{prefix}self_attn.o_proj.weight": rand(H, nh * hd),
        f"{prefix}mlp.gate_proj.weight": rand(inter, H),
        f"{prefix}mlp.up_proj.weight": rand(inter, H),
        f"{prefix}mlp.down_proj.weight": rand(H, inter),
        f"{prefix}post_attention_layernorm.weight": torch.ones(H),
    }


def build_eagle_head(
    target_dir: str | os.PathLike[str],
    *,
    method: str = "eagle",
    seed: int = 0,
    std: float = 0.1,
    draft_vocab_size: int | None = None,
) -> Path:
    """A random EAGLE-1 (``method="eagle"``) or EAGLE-3 (``"eagle3"``) head for the tiny Llama at ``target_dir``.

    EAGLE-3: ``draft_vocab_size`` (default: half the target vocabulary) sets the draft LM head's rows; ``d2t[i]`` is
    the offset from draft id ``i`` to its target id (here the even target ids). The target needs at least 7 layers
    for vLLM 0.11 to pick three distinct auxiliary layers ``(2, n // 2, n - 3)``. Returns the head's directory."""
    if method not in ("eagle", "eagle3"):
        raise ValueError(f"build_eagle_head: method must be 'eagle' or 'eagle3', got {method!r}")
    target = Path(target_dir)
    cfg = _head_config(target, method, draft_vocab_size)
    if method == "eagle3" and draft_vocab_size is None:
        cfg.draft_vocab_size = cfg.vocab_size // 2
    key = _key("eagle-head-v1", method, _target_key(target), seed, std, getattr(cfg, "draft_vocab_size", None))
    out = default_cache_dir() / f"{method}-head-{key}"
    return cached_build(out, key, lambda d: _write_head(d, cfg, method, seed, std))


def _write_head(out: Path, cfg: Any, method: str, seed: int, std: float) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    H, V = cfg.hidden_size, cfg.vocab_size
    weights: dict[str, torch.Tensor] = {"embed_tokens.weight": rand(V, H)}
    if method == "eagle":
        weights["fc.weight"] = rand(H, 2 * H)
        weights.update(_layer_weights("layers.0.", cfg, H, rand))
    else:
        dv = cfg.draft_vocab_size
        weights["fc.weight"] = rand(H, 3 * H)
        weights.update(_layer_weights("midlayer.", cfg, 2 * H, rand))
        weights["midlayer.input_layernorm.weight"] = torch.ones(H)
        weights["midlayer.hidden_norm.weight"] = torch.ones(H)
        weights["norm.weight"] = torch.ones(H)
        weights["lm_head.weight"] = rand(dv, H)
        target_ids = torch.arange(dv) * (V // dv)
        weights["d2t"] = target_ids - torch.arange(dv)
        weights["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, target_ids, True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    cfg.save_pretrained(out)


def train_eagle_head(
    target_dir: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    steps: int = 300,
    lr: float = 3e-3,
    seed: int = 0,
) -> Path:
    """An EAGLE-1 head for the tiny Llama at ``target_dir``, trained on the target's greedy continuations.

    The head is trained as vLLM runs it: at position ``t`` it reads the target's final (normed) hidden state
    ``h_t`` and the embedding of token ``t + 1``, and predicts token ``t + 2`` through the target's LM head
    (``lm_head(layer(fc(cat(embed(x[t+1]), h_t))))``, the layer without its input norm, causal attention, RoPE at
    position ``t``), and its output is pulled towards the target's next hidden state ``h_{t+1}`` (EAGLE's feature
    loss: at serving time the head's output is the hidden input of the next draft position). Embedding and LM head
    are the target's (frozen, shared at serving time: the checkpoint carries no ``embed_tokens``, as EAGLE-1 heads
    that share the target's embedding ship. vLLM 0.11.1/0.11.2 mark a head whose checkpoint has ``embed_tokens`` as
    having its own embedding but never load it (``EagleLlamaForCausalLM.load_weights`` still skips the name with
    PP=1; vllm#28549), so such a head drafts from an uninitialised embedding). ``steps`` full-batch
    Adam steps over ``prompts`` plus their ``max_new_tokens`` greedy tokens. Cached by content."""
    target = Path(target_dir)
    key = _key("eagle-trained-v3", _target_key(target), [list(p) for p in prompts], max_new_tokens, steps, lr, seed)
    out = default_cache_dir() / f"eagle-trained-{key}"
    return cached_build(out, key, lambda d: _train_head(d, target, prompts, max_new_tokens, steps, lr, seed))


def _train_head(
    out: Path, target: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, steps: int, lr: float, seed: int
) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    cfg = _head_config(target, "eagle", None)
    cfg._attn_implementation = "sdpa"  # no mask given: sdpa runs causal
    with torch.no_grad():
        seqs, hiddens = [], []
        for ids in prompts:
            inp = torch.tensor([list(ids)])
            gen = model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=model.config.pad_token_id,
            )[0]
            seqs.append(gen)
            hiddens.append(model(gen[None], output_hidden_states=True).hidden_states[-1][0])
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()  # type: ignore[assignment]
    rotary = LlamaRotaryEmbedding(cfg)
    params = [*fc.parameters(), *layer.parameters()]
    with torch.no_grad():
        for p in params:
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    opt = torch.optim.Adam(params, lr=lr)

    def loss_of(seq: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        n = seq.shape[0] - 2
        x = fc(torch.cat([embed(seq[1 : n + 1]), hidden[:n]], dim=-1))[None]
        pos = torch.arange(n)[None]
        y = layer(x, position_ids=pos, position_embeddings=rotary(x, pos))
        y = (y[0] if isinstance(y, tuple) else y)[0]
        # EAGLE's two losses: the next token, and the target's next feature (vLLM feeds the head's own output back
        # as the hidden state of the following draft position)
        return torch.nn.functional.cross_entropy(lm_head(y), seq[2:]) + torch.nn.functional.mse_loss(
            y, hidden[1 : n + 1]
        )

    for _ in range(steps):
        opt.zero_grad()
        loss = sum(loss_of(s, h) for s, h in zip(seqs, hiddens, strict=True)) / len(seqs)
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        opt.step()
    weights = {"fc.weight": fc.weight}  # no embed_tokens: vLLM shares the target's (see the docstring)
    for name, p in layer.named_parameters():
        weights[f"layers.0.{name}"] = p
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(out)
    (out / "train.json").write_text(json.dumps({"final_loss": float(loss.detach()), "steps": steps}))


def build_mtp_model(config: Any, *, seed: int = 0, std: float = 0.2) -> Path:
    """A DeepSeek-V3 checkpoint for ``config`` with one MTP layer: ``model.layers.<n>.*`` for
    ``n = config.num_hidden_layers``, ``num_nextn_predict_layers = 1`` in its config.

    The MTP layer's decoder block is layer ``n`` of a seeded random ``n + 1``-layer model (an MoE block when
    ``n >= first_k_dense_replace`` and ``n % moe_layer_freq == 0``, vLLM's rule; dense otherwise), plus the MTP
    parts: ``enorm``/``hnorm`` and ``shared_head.norm`` (scales), ``eh_proj [H, 2H]``, ``shared_head.head [V, H]``
    and a copy of the target's ``embed_tokens``. Layers ``0..n-1`` are the same weights HF loads."""
    import transformers

    if config.model_type != "deepseek_v3":
        raise ValueError(f"build_mtp_model: expected a DeepSeek-V3 config, got {config.model_type!r}")
    tokenizer = build_tokenizer(vocab_size=min(config.vocab_size, 512))
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.torch_dtype = "float32"
    config.initializer_range = std
    n = config.num_hidden_layers
    full = transformers.DeepseekV3Config(**{**config.to_dict(), "num_hidden_layers": n + 1})
    key = _key("mtp-v2", config.to_dict(), seed, std)
    out = default_cache_dir() / f"deepseek_v3-mtp-{key}"
    return cached_build(out, key, lambda d: _write_mtp(d, config, full, tokenizer, seed, std))


def _write_mtp(out: Path, config: Any, full: Any, tokenizer: Any, seed: int, std: float) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    write_random_checkpoint(
        full, out, transformers.AutoModelForCausalLM, lambda: tokenizer, seed=seed, std=std, dtype="float32"
    )
    (shard,) = out.glob("*.safetensors")
    n = config.num_hidden_layers
    weights = load_file(str(shard))
    gen = torch.Generator().manual_seed(seed + 1)
    H, V, p = config.hidden_size, config.vocab_size, f"model.layers.{n}."
    weights[p + "enorm.weight"] = torch.rand(H, generator=gen) + 0.5
    weights[p + "hnorm.weight"] = torch.rand(H, generator=gen) + 0.5
    weights[p + "shared_head.norm.weight"] = torch.rand(H, generator=gen) + 0.5
    weights[p + "eh_proj.weight"] = torch.randn(H, 2 * H, generator=gen) * std
    weights[p + "shared_head.head.weight"] = torch.randn(V, H, generator=gen) * std
    weights[p + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    if n >= config.first_k_dense_replace and n % freq:
        # vLLM's rule makes this layer dense (HF's has no moe_layer_freq and built it MoE): a dense MLP instead
        for key in [k for k in weights if k.startswith(p + "mlp.")]:
            del weights[key]
        inter = config.intermediate_size
        weights[p + "mlp.gate_proj.weight"] = torch.randn(inter, H, generator=gen) * std
        weights[p + "mlp.up_proj.weight"] = torch.randn(inter, H, generator=gen) * std
        weights[p + "mlp.down_proj.weight"] = torch.randn(H, inter, generator=gen) * std
    save_file(weights, str(shard), metadata={"format": "pt"})
    config.num_nextn_predict_layers = 1
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(out)
