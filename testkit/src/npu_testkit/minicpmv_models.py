# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A tiny MiniCPM-V 2.6 built on the fly without the hub, and its reference.

MiniCPM-V's config, processor and model classes are hub remote code (not in transformers 4.57). The checkpoint dir
written here carries its own remote code (:mod:`npu_testkit.minicpmv_code`: config, image processor, processor,
named in ``auto_map``), so vLLM loads it with ``trust_remote_code`` and no network. The model itself is 2.6's
layout as vLLM 0.11's ``MiniCPMV2_6`` builds it: a SigLIP/Idefics2 navit vision tower (``vpm``), a perceiver
resampler (``resampler``: learned queries cross-attending the tower's tokens plus a 2D sin-cos position embedding,
then LayerNorm and a projection) and a Qwen2 language model (``llm``).

There is no HF model class to compare against, so :class:`MiniCPMVReference` assembles one from parts transformers
4.57 has (``Idefics2VisionTransformer``, ``Qwen2ForCausalLM``) plus a plain-torch resampler, and writes the
checkpoint from its own weights: each slice runs through the tower alone (no padding), as the reference model's
masked batch would; the tower's position ids are MiniCPM-V's (:func:`navit_position_ids`).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from pathlib import Path
from typing import Any

from .mm_models import _family_tokenizer
from .models import _fingerprint, default_cache_dir

#: The image tokens of MiniCPM-V 2.6's processor (attribute of the tokenizer -> token); ``<unk>`` is the token each
#: image feature replaces (vLLM looks it up by that text).
MINICPMV_TOKENS = {
    "im_start_token": "<image>",
    "im_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "im_id_start_token": "<image_id>",
    "im_id_end_token": "</image_id>",
    "placeholder_token": "<unk>",
}
MINICPMV_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}(<image>./</image>)\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: The prompt pattern of one image (the processor and vLLM expand it) and of one video (vLLM expands it).
IMAGE_PATTERN, VIDEO_PATTERN = "(<image>./</image>)", "(<video>./</video>)"
#: Slicing scale (pixels; a slice has about this squared area), patch side, tokens per slice, most slices.
SCALE_RESOLUTION, PATCH, QUERY_NUM, MAX_SLICES = 56, 14, 8, 4


def tiny_minicpmv_config() -> Any:
    """A tiny MiniCPM-V 2.6 config (the remote-code ``MiniCPMVConfig``): Qwen2 text hidden 256 (the resampler's
    ``hidden // 128`` = 2 heads), 2 layers, GQA 4/2; SigLIP navit width 32, 2 layers, 2 heads, patch 14, 5x5
    position buckets; 8 queries per slice."""
    from .minicpmv_code.configuration_minicpm import MiniCPMVConfig

    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 70,
        "patch_size": PATCH,
        "layer_norm_eps": 1e-6,
    }
    config = MiniCPMVConfig(
        vision_config=vision,
        query_num=QUERY_NUM,
        image_size=SCALE_RESOLUTION,
        slice_config={"max_slice_nums": MAX_SLICES, "patch_size": PATCH, "scale_resolution": SCALE_RESOLUTION},
        version=2.6,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    config.architectures = ["MiniCPMV"]
    config.auto_map = {"AutoConfig": "configuration_minicpm.MiniCPMVConfig"}
    return config


def _image_processor_config(config: Any) -> dict[str, Any]:
    return {
        "image_processor_type": "MiniCPMVImageProcessor",
        "processor_class": "MiniCPMVProcessor",
        "auto_map": {
            "AutoImageProcessor": "image_processing_minicpmv.MiniCPMVImageProcessor",
            "AutoProcessor": "processing_minicpmv.MiniCPMVProcessor",
        },
        "max_slice_nums": MAX_SLICES,
        "scale_resolution": SCALE_RESOLUTION,
        "patch_size": PATCH,
        "use_image_id": True,
        "image_feature_size": config.query_num,
        "slice_mode": True,
        "norm_mean": [0.5, 0.5, 0.5],
        "norm_std": [0.5, 0.5, 0.5],
    }


def _remote_code_dir() -> Path:
    return Path(__file__).parent / "minicpmv_code"


def build_tiny_minicpmv_model(path: str | os.PathLike[str] | None = None, *, seed: int = 0, std: float = 0.2) -> Path:
    """Write a tiny MiniCPM-V 2.6 checkpoint (:func:`tiny_minicpmv_config`, random weights drawn by
    :class:`MiniCPMVReference`) with its remote code, tokenizer and processor configs; returns the dir."""
    import json

    import torch
    from safetensors.torch import save_file

    from .cache import cached_build
    from .minicpmv_code import REMOTE_CODE_FILES

    config = tiny_minicpmv_config()
    tok = _family_tokenizer("Qwen2TokenizerFast", MINICPMV_TOKENS, MINICPMV_CHAT_TEMPLATE)
    config.vocab_size = max(config.vocab_size, len(tok))
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    config.torch_dtype = "float32"
    code = hashlib.sha256(b"".join((_remote_code_dir() / f).read_bytes() for f in REMOTE_CODE_FILES)).hexdigest()
    key = _fingerprint(config.to_dict(), seed, std, f"minicpmv:{MINICPMV_TOKENS}:{MINICPMV_CHAT_TEMPLATE}:{code}")

    def build(out: Path) -> None:
        torch.manual_seed(seed)
        model = MiniCPMVReference(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, std)
                elif ("norm" in name or ".ln_" in name) and name.endswith("weight"):
                    param.uniform_(0.5, 1.5)
                else:
                    param.normal_(0.0, std / 4)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
        config.save_pretrained(out)
        tok.save_pretrained(out)
        (out / "preprocessor_config.json").write_text(json.dumps(_image_processor_config(config), indent=2))
        for name in REMOTE_CODE_FILES:
            shutil.copy(_remote_code_dir() / name, out / name)

    out = Path(path) if path is not None else default_cache_dir() / f"minicpmv-{key}"
    return cached_build(out, key, build)


def minicpmv_prompt(*parts: str) -> str:
    """A prompt of text parts and "image" / "video" parts (each the :data:`IMAGE_PATTERN` / :data:`VIDEO_PATTERN`
    line the chat template writes)."""
    patterns = {"image": f"{IMAGE_PATTERN}\n", "video": f"{VIDEO_PATTERN}\n"}
    return "".join(patterns.get(p, p) for p in parts)


# --- the reference ----------------------------------------------------------------------------------------------


def sincos_2d(dim: int, rows: int, cols: int) -> Any:
    """The resampler's 2D sin-cos position embedding ``[rows * cols, dim]`` (row-major): the patch at ``(i, j)``
    gets ``[sin(j w), cos(j w), sin(i w), cos(i w)]`` with ``w_k = 10000 ** (-k / (dim / 4))``, ``k < dim / 4``."""
    import torch

    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))

    def one(n: int) -> torch.Tensor:
        angles = torch.arange(n, dtype=torch.float64)[:, None] * omega[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)  # [n, dim / 2]

    across, down = one(cols), one(rows)
    grid = torch.cat([across[None, :, :].expand(rows, -1, -1), down[:, None, :].expand(-1, cols, -1)], dim=-1)
    return grid.reshape(rows * cols, dim).float()


def navit_position_ids(rows: int, cols: int, per_side: int) -> Any:
    """Position-embedding ids ``[rows * cols]`` of a ``rows x cols`` patch grid in MiniCPM-V's navit SigLIP (and
    vLLM's ``Idefics2VisionEmbeddings``): fractional coordinates ``arange(0, 1 - 1e-6, 1 / n)`` bucketed into
    ``per_side`` buckets. (transformers 4.57's ``Idefics2VisionEmbeddings`` buckets ``i / n * (1 - 1e-6)`` instead,
    which lands one bucket lower wherever ``i / n`` hits a boundary, e.g. 5 patches over 5 buckets: not used.)"""
    import torch

    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    down = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / rows), boundaries, right=True)
    across = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / cols), boundaries, right=True)
    return (down[:, None] * per_side + across[None, :]).flatten()


def _torch_modules() -> Any:
    import torch
    from torch import nn

    class ReferenceResampler(nn.Module):
        """One cross-attention of ``num_queries`` learned queries over one slice's tower tokens (plain torch; the
        parameters are named as vLLM's ``Resampler2_5`` loads them)."""

        def __init__(self, num_queries: int, embed_dim: int, num_heads: int, kv_dim: int) -> None:
            super().__init__()
            self.num_heads = num_heads
            self.query = nn.Parameter(torch.empty(num_queries, embed_dim))
            self.kv_proj = nn.Linear(kv_dim, embed_dim, bias=False)
            self.attn = nn.MultiheadAttention(embed_dim, num_heads)  # holds in_proj_* and out_proj only
            self.ln_q, self.ln_kv, self.ln_post = (nn.LayerNorm(embed_dim, eps=1e-6) for _ in range(3))
            self.proj = nn.Parameter(torch.empty(embed_dim, embed_dim))

        def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
            """``x [rows * cols, kv_dim]`` -> ``[num_queries, embed_dim]``."""
            kv = self.ln_kv(self.kv_proj(x))
            q = self.ln_q(self.query)
            dim = q.shape[-1]
            wq, wk, wv = self.attn.in_proj_weight.chunk(3)
            bq, bk, bv = self.attn.in_proj_bias.chunk(3)
            heads, hd = self.num_heads, dim // self.num_heads
            qh = (q @ wq.T + bq).view(-1, heads, hd).transpose(0, 1)
            kh = ((kv + sincos_2d(dim, rows, cols).to(kv.dtype)) @ wk.T + bk).view(-1, heads, hd).transpose(0, 1)
            vh = (kv @ wv.T + bv).view(-1, heads, hd).transpose(0, 1)
            weights = torch.softmax(qh @ kh.transpose(1, 2) / math.sqrt(hd), dim=-1)
            out = (weights @ vh).transpose(0, 1).reshape(-1, dim)
            out = out @ self.attn.out_proj.weight.T + self.attn.out_proj.bias
            return self.ln_post(out) @ self.proj

    return ReferenceResampler


def MiniCPMVReference(config: Any) -> Any:  # noqa: N802 - a class factory (torch is imported lazily)
    """The reference MiniCPM-V 2.6 as an ``nn.Module`` with ``llm`` (transformers ``Qwen2ForCausalLM``), ``vpm``
    (transformers ``Idefics2VisionTransformer``) and ``resampler`` (plain torch), parameter names as in the
    checkpoint; ``embed(input_ids [T], pixel_values, tgt_sizes) -> [T, hidden]`` puts the slices' features on the
    ``<unk>`` positions in order."""
    import torch
    import transformers
    from torch import nn
    from transformers.models.idefics2.configuration_idefics2 import Idefics2VisionConfig
    from transformers.models.idefics2.modeling_idefics2 import Idefics2VisionTransformer

    resampler_cls = _torch_modules()
    vision = Idefics2VisionConfig(**config.vision_config.to_dict())
    vision._attn_implementation = "eager"
    text = transformers.Qwen2Config(**{k: v for k, v in config.to_dict().items() if k != "vision_config"})
    text.architectures = ["Qwen2ForCausalLM"]
    text._attn_implementation = "eager"

    class Reference(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.llm = transformers.Qwen2ForCausalLM(text)
            self.vpm = Idefics2VisionTransformer(vision)
            self.resampler = resampler_cls(
                config.query_num, config.hidden_size, config.hidden_size // 128, vision.hidden_size
            )

        def slice_features(self, pixels: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
            """One slice laid out by patch ``[3, p, rows * cols * p]`` -> ``[query_num, hidden]``."""
            p = vision.patch_size
            image = pixels.reshape(3, p, rows, cols, p).permute(0, 2, 1, 3, 4).reshape(3, rows * p, cols * p)
            emb = self.vpm.embeddings
            hidden = emb.patch_embedding(image[None]).flatten(2).transpose(1, 2)
            hidden = hidden + emb.position_embedding(navit_position_ids(rows, cols, emb.num_patches_per_side))
            hidden = self.vpm.post_layernorm(self.vpm.encoder(inputs_embeds=hidden).last_hidden_state)
            out: torch.Tensor = self.resampler(hidden[0], rows, cols)
            return out

        def embed(self, input_ids: torch.Tensor, pixel_values: list[Any], tgt_sizes: Any, unk_id: int) -> Any:
            embeds = self.llm.get_input_embeddings()(input_ids)
            if pixel_values:
                feats = torch.cat(
                    [self.slice_features(px, int(h), int(w)) for px, (h, w) in zip(pixel_values, tgt_sizes.tolist())]
                )
                where = (input_ids == unk_id).nonzero().flatten()
                if len(where) != len(feats):
                    raise AssertionError(f"{len(where)} <unk> positions for {len(feats)} image features")
                embeds = embeds.clone()
                embeds[where] = feats
            return embeds

    return Reference()


def load_reference(model_dir: str | os.PathLike[str]) -> Any:
    """:func:`MiniCPMVReference` with the checkpoint's weights (float32, eval)."""
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    model = MiniCPMVReference(config)
    model.load_state_dict(load_file(str(Path(model_dir) / "model.safetensors")))
    return model.eval()


def reference_greedy(
    model_dir: str | os.PathLike[str], requests: list[dict[str, Any]], max_new_tokens: int, banned: set[int]
) -> list[tuple[list[int], list[int]]]:
    """Greedy continuations by :func:`load_reference`, one request at a time, a full forward per step; prompts
    through the checkpoint's own processor (``AutoProcessor``, remote code); a "video" (``[T, H, W, 3]`` frames, one
    per prompt, after its images) as its frames. Returns ``(prompt_ids, generated)``."""
    import torch
    import transformers
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(model_dir, trust_remote_code=True)
    model = load_reference(model_dir)
    unk_id = processor.tokenizer.convert_tokens_to_ids("<unk>")
    outputs = []
    with torch.no_grad():
        for req in requests:
            media = req.get("multi_modal_data") or {}
            images = media.get("image")
            images = [] if images is None else images if isinstance(images, list) else [images]
            prompt_text, kwargs = req["prompt"], {}
            if media.get("video") is not None:
                if images:
                    raise ValueError("reference_greedy: a video prompt takes no images (its frames have no ids)")
                # MiniCPM-V 2.6's video convention: the frames as unsliced images without ids.
                frames = [Image.fromarray(f) for f in media["video"]]
                prompt_text = prompt_text.replace(VIDEO_PATTERN, IMAGE_PATTERN * len(frames), 1)
                images, kwargs = [*images, *frames], {"max_slice_nums": 1, "use_image_id": False}
            inputs = processor(text=[prompt_text], images=[images] if images else None, **kwargs)
            prompt = inputs["input_ids"][0]
            pixels = inputs["pixel_values"][0] if images else []
            tgt = inputs["tgt_sizes"][0] if images else None
            embeds = model.embed(prompt, pixels, tgt, unk_id)
            generated: list[int] = []
            for _ in range(max_new_tokens):
                logits = model.llm(inputs_embeds=embeds[None], use_cache=False).logits[0, -1].clone()
                logits[sorted(banned)] = float("-inf")
                token = int(logits.argmax())
                generated.append(token)
                embeds = torch.cat([embeds, model.llm.get_input_embeddings()(torch.tensor([token]))])
            outputs.append((prompt.tolist(), generated))
    return outputs
