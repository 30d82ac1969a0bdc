# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A tiny InternVL2 / InternVL2.5 checkpoint in the hub's remote-code layout (``InternVLChatModel``), converted from
a tiny transformers-format InternVL (``InternVLForConditionalGeneration``, the same InternViT + pixel shuffle + MLP
projector maths), so the transformers model is its HF reference.

The remote-code layout, as the released repos (OpenGVLab/InternVL2-1B, InternVL2_5-1B, ...) store it:

* ``config.json``: ``model_type: internvl_chat``, ``architectures: [InternVLChatModel]``, ``auto_map.AutoConfig``
  naming ``configuration_internvl_chat.InternVLChatConfig`` (hub code: here our own
  :mod:`npu_testkit.internvl_chat_config`, copied in), ``vision_config`` (InternViT), ``llm_config`` (the language
  model's config), ``downsample_ratio``, ``ps_version: v2``, ``select_layer``, ``force_image_size``, the dynamic
  tiling fields;
* weights ``vision_model.*`` (InternViT with ONE fused ``attn.qkv``, rows q then k then v, ``attn.proj``,
  ``ls1``/``ls2`` layer scales, ``norm1``/``norm2``), ``mlp1.{0,1,3}`` (LayerNorm, Linear, GELU, Linear) and
  ``language_model.*`` (the language model's own checkpoint names, ``model.*`` + ``lm_head``).

:data:`HF_TO_CHAT` is the name mapping from transformers' port; q/k/v are fused by concatenating rows (what the hub
``InternAttention`` splits with ``reshape(B, N, 3, heads, head_dim)``). vLLM 0.11 builds the processor itself
(``InternVLProcessor``, from the tokenizer: ``<image>`` in a prompt becomes ``<img>`` + ``<IMG_CONTEXT>`` x tokens +
``</img>``), so the checkpoint carries no processor code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from .cache import cached_build
from .mm_models import (
    INTERNVL_CHAT_TEMPLATE,
    INTERNVL_MAX_TILES,
    INTERNVL_TOKENS,
    tiny_internvl_config,
)
from .models import _fingerprint, default_cache_dir

#: transformers-format checkpoint name (regex; as ``save_pretrained`` writes them, which is also how the ``-hf`` hub
#: repos store them) -> remote-code name; q/k/v projections are fused separately.
HF_TO_CHAT: tuple[tuple[str, str], ...] = (
    (r"^vision_tower\.embeddings\.cls_token$", "vision_model.embeddings.class_embedding"),
    (r"^vision_tower\.embeddings\.position_embeddings$", "vision_model.embeddings.position_embedding"),
    (r"^vision_tower\.embeddings\.patch_embeddings\.projection\.", "vision_model.embeddings.patch_embedding."),
    (
        r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.projection_layer\.",
        r"vision_model.encoder.layers.\1.attn.proj.",
    ),
    (
        r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.([qk])_norm\.",
        r"vision_model.encoder.layers.\1.attn.\2_norm.",
    ),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.lambda_1$", r"vision_model.encoder.layers.\1.ls1"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.lambda_2$", r"vision_model.encoder.layers.\1.ls2"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_before\.", r"vision_model.encoder.layers.\1.norm1."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_after\.", r"vision_model.encoder.layers.\1.norm2."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.mlp\.", r"vision_model.encoder.layers.\1.mlp."),
    (r"^multi_modal_projector\.layer_norm\.", "mlp1.0."),
    (r"^multi_modal_projector\.linear_1\.", "mlp1.1."),
    (r"^multi_modal_projector\.linear_2\.", "mlp1.3."),
    (r"^language_model\.", "language_model."),  # already ``language_model.model.*`` / ``.lm_head``
)
#: InternViT's per-block layer scales in the transformers-format checkpoint.
LAYER_SCALE = re.compile(r"^vision_tower\.encoder\.layer\.\d+\.lambda_[12]$")
_QKV = re.compile(r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.([qkv])_proj\.(weight|bias)$")

#: The tokenizer files copied from the transformers-format checkpoint (the hub repos ship a Qwen2 tokenizer too).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
#: The checkpoint's chat template: ChatML whose image parts become the ``<image>`` placeholder vLLM's
#: ``InternVLChatModel`` expands (the transformers format's template writes ``<IMG_CONTEXT>`` instead).
CHAT_TEMPLATE = INTERNVL_CHAT_TEMPLATE.replace("<IMG_CONTEXT>", "<image>")
#: Tiles per image at most (a thumbnail is added to multi-tile images), as the transformers processor's.
MAX_TILES = INTERNVL_MAX_TILES


def tiny_internvl_hf_config() -> Any:
    """The transformers-format reference config: :func:`npu_testkit.mm_models.tiny_internvl_config` with q/k/v
    biases (InternViT-300M, the tower of InternVL2/2.5 1B-8B, has ``qkv_bias: true``)."""
    config = tiny_internvl_config()
    config.vision_config.attention_bias = True
    return config


def build_tiny_internvl_hf_model(*, seed: int = 0, std: float = 0.2) -> Path:
    """Save random weights for :func:`tiny_internvl_hf_config` with its ``InternVLProcessor`` (the reference
    model of the remote-code checkpoint); returns the dir."""
    import transformers

    from .mm_models import internvl_tokenizer_and_processor
    from .models import write_random_checkpoint

    config = tiny_internvl_hf_config()
    processor = internvl_tokenizer_and_processor(config)

    def build(out: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        write_random_checkpoint(
            config, out, transformers.AutoModelForImageTextToText, processor, seed=seed, std=std, dtype="float32"
        )
        # InternViT's layer scales come out of the generic init as N(0, std/4): they would scale every block's
        # attention and MLP down to ~5% of the residual, so a wrong encoder attention would barely move the
        # features. Drawn U(0.5, 1.5) instead, the vision attention decides the image tokens.
        gen = torch.Generator().manual_seed(seed)
        for shard in out.glob("*.safetensors"):
            state = load_file(shard)
            for name in [n for n in state if LAYER_SCALE.search(n)]:
                state[name] = torch.rand(state[name].shape, generator=gen, dtype=state[name].dtype) + 0.5
            save_file(state, shard, metadata={"format": "pt"})

    key = _fingerprint(config.to_dict(), seed, std, f"internvl-hf:{INTERNVL_TOKENS}:{INTERNVL_CHAT_TEMPLATE}:ls")
    return cached_build(default_cache_dir() / f"internvl-hf-{key}", key, build)


def chat_config_dict(hf_config: Any) -> dict[str, Any]:
    """The remote-code ``config.json`` content for a transformers-format ``InternVLConfig``."""
    vision, text = hf_config.vision_config, hf_config.text_config
    image_size, patch_size = vision.image_size[0], vision.patch_size[0]
    if vision.image_size[0] != vision.image_size[1] or vision.patch_size[0] != vision.patch_size[1]:
        raise ValueError("InternViT tiles are square: image_size and patch_size must be too")
    if not vision.use_mean_pooling or hf_config.vision_feature_select_strategy != "default":
        raise ValueError("the remote-code layout has no final ViT norm and always drops the CLS token")
    llm = text.to_dict()
    llm.pop("transformers_version", None)
    return {
        "architectures": ["InternVLChatModel"],
        "auto_map": {
            "AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
        },
        "model_type": "internvl_chat",
        "torch_dtype": "float32",
        "template": "internvl2_5",
        "downsample_ratio": hf_config.downsample_ratio,
        "ps_version": "v2",  # transformers' pixel shuffle is the v2 one (the final permute)
        "select_layer": hf_config.vision_feature_layer,
        "force_image_size": image_size,
        "dynamic_image_size": True,
        "use_thumbnail": True,
        "min_dynamic_patch": 1,
        "max_dynamic_patch": MAX_TILES,
        "use_backbone_lora": 0,
        "use_llm_lora": 0,
        "vision_config": {
            "model_type": "intern_vit_6b",
            "architectures": ["InternVisionModel"],
            "num_channels": vision.num_channels,
            "image_size": image_size,
            "patch_size": patch_size,
            "hidden_size": vision.hidden_size,
            "num_attention_heads": vision.num_attention_heads,
            "intermediate_size": vision.intermediate_size,
            "num_hidden_layers": vision.num_hidden_layers,
            "qkv_bias": vision.attention_bias,
            "qk_normalization": vision.use_qk_norm,
            "norm_type": vision.norm_type,
            "layer_norm_eps": vision.layer_norm_eps,
            "hidden_act": vision.hidden_act,
            "initializer_factor": vision.layer_scale_init_value,
            "use_flash_attn": False,
        },
        "llm_config": llm,
    }


def chat_state_dict(hf_state: dict[str, Any]) -> dict[str, Any]:
    """Rename a transformers-format InternVL state dict into the remote-code layout, fusing each layer's q/k/v
    projections into one ``attn.qkv`` (rows q, k, v). Every input tensor lands in exactly one output tensor."""
    import torch

    out: dict[str, Any] = {}
    qkv: dict[tuple[str, str], dict[str, Any]] = {}
    for name, tensor in hf_state.items():
        fused = _QKV.match(name)
        if fused:
            layer, which, kind = fused.groups()
            qkv.setdefault((layer, kind), {})[which] = tensor
            continue
        for pattern, repl in HF_TO_CHAT:
            if re.match(pattern, name):
                out[re.sub(pattern, repl, name)] = tensor
                break
        else:
            raise KeyError(f"no remote-code name for {name!r}")
    for (layer, kind), parts in qkv.items():
        if sorted(parts) != ["k", "q", "v"]:
            raise KeyError(f"layer {layer} {kind}: q/k/v incomplete ({sorted(parts)})")
        out[f"vision_model.encoder.layers.{layer}.attn.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def _convert(hf_dir: Path, out: Path) -> None:
    import transformers
    from safetensors.torch import load_file, save_file

    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    state = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(shard))
    save_file({k: v.contiguous() for k, v in chat_state_dict(state).items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(chat_config_dict(hf_config), indent=2, sort_keys=True))
    shutil.copyfile(Path(__file__).with_name("internvl_chat_config.py"), out / "configuration_internvl_chat.py")
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out / name)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def build_tiny_internvl_chat_model(
    hf_dir: str | os.PathLike[str] | None = None, path: str | os.PathLike[str] | None = None
) -> Path:
    """The remote-code InternVL2.5 checkpoint converted from ``hf_dir`` (default
    :func:`build_tiny_internvl_hf_model`); served with ``trust_remote_code=True``. Cached by the source's content."""
    src = Path(hf_dir) if hf_dir is not None else build_tiny_internvl_hf_model()
    source_key = (src / ".complete").read_text() if (src / ".complete").is_file() else str(src.resolve())
    code = Path(__file__).with_name("internvl_chat_config.py").read_text()
    key = _fingerprint({"source": source_key}, 0, 0.0, f"internvl-chat:{code}:{HF_TO_CHAT}:{MAX_TILES}:{CHAT_TEMPLATE}")
    out = Path(path) if path is not None else default_cache_dir() / f"internvl_chat-{key}"
    return cached_build(out, key, lambda d: _convert(src, d))


def internvl_chat_prompt(*parts: str) -> str:
    """One user turn plus the assistant header (ChatML, as InternVL2.5's ``internvl2_5`` template renders it with
    no system prompt); "image" parts become the ``<image>`` placeholder vLLM's processor expands, then a newline."""
    body = "".join("<image>\n" if p == "image" else p for p in parts)
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def hf_prompt(*parts: str) -> str:
    """:func:`internvl_chat_prompt` for the transformers processor (``<IMG_CONTEXT>`` placeholders)."""
    body = "".join("<IMG_CONTEXT>\n" if p == "image" else p for p in parts)
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def hf_internvl_greedy(
    model: Any, inputs: list[tuple[list[int], Any]], max_new_tokens: int, banned: set[int]
) -> list[list[int]]:
    """Greedy continuations of the transformers-format ``model`` (float32, a full forward per step, no KV cache,
    ``banned`` ids masked) for ``(prompt_ids, pixel_values or None)`` pairs, one at a time."""
    import torch

    outputs = []
    with torch.no_grad():
        for prompt, pixels in inputs:
            ids = torch.tensor([prompt])
            extra = {} if pixels is None else {"pixel_values": pixels}
            for _ in range(max_new_tokens):
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **extra).logits
                last = logits[:, -1].clone()
                last[:, sorted(banned)] = float("-inf")
                ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
            outputs.append(ids[0, len(prompt) :].tolist())
    return outputs
