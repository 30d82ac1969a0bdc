# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Tiny Qwen vision-language checkpoints built on the fly (no hub downloads), synthetic media, and HF references.

``build_tiny_vl_model(config)`` saves random weights for a Qwen2-VL / Qwen2.5-VL ``transformers`` config together with
a locally assembled processor: the demo's byte-level BPE tokenizer plus the vision special tokens
(:data:`VISION_TOKENS`) and a chat template that renders image/video content parts, an image processor and a video
processor sized for tiny media (so vLLM's profiling run stays small). vLLM and HF load the very same directory.
Builds are cached by content like :func:`npu_testkit.models.build_tiny_model`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .models import _fingerprint, _save_random_checkpoint, build_tokenizer

#: The vision special tokens of the Qwen VL family, in the order their ids are assigned after the text vocabulary.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

#: ChatML with Qwen-VL content parts: {"type": "image"} / {"type": "video"} become one placeholder each (the
#: processor expands it to the item's token count), {"type": "text"} its text; plain string content is kept.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Pixel bounds of the tiny processors (one merged 28x28 cell = one LLM token): images up to 64 tokens, video
#: frames up to 16 tokens per temporal pair. Small bounds keep vLLM's profiling (largest dummy item) cheap.
IMAGE_PIXELS = (56 * 56, 28 * 28 * 64)
VIDEO_PIXELS = (56 * 56, 28 * 28 * 16)

_TEXT_TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    # head_dim 16: MRoPE splits its 8 rotary frequencies into temporal/height/width sections.
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "tie_word_embeddings": False,
}

#: Qwen2-VL's vision tower: 2 blocks, width 160, 2 heads of dim 80 (the released towers' head dim, which the NPU
#: override pads to 128), 14-pixel patches merged 2x2.
QWEN2_VL_VISION_TINY: dict[str, Any] = {
    "depth": 2,
    "embed_dim": 160,
    "hidden_size": 64,  # the merger's output = the LLM's hidden size
    "mlp_ratio": 2,
    "num_heads": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

#: Qwen2.5-VL's vision tower: 3 blocks, block 1 full attention and blocks 0/2 window attention over 2x2 merged cells
#: (window_size 56 pixels), so images wider than one window are split (and padded where not divisible); width 160,
#: 2 heads of dim 80 like the released towers (padded to 128 by the NPU override).
QWEN2_5_VL_VISION_TINY: dict[str, Any] = {
    "depth": 3,
    "hidden_size": 160,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "tokens_per_second": 2,
}


#: Qwen3-VL's vision tower: 2 blocks, width 32, 2 heads, 16-pixel patches merged 2x2, learned position embeddings
#: on an 8x8 grid (interpolated to each image), block 0's features also fed to the LLM (DeepStack).
QWEN3_VL_VISION_TINY: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0],
}

#: Qwen3-VL's text model differs from Qwen2's in head_dim (explicit), q/k norms and interleaved MRoPE sections.
_QWEN3_TEXT_TINY: dict[str, Any] = {
    **_TEXT_TINY,
    "head_dim": 16,
    "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
}

#: Qwen3-VL-MoE's text model: every layer MoE, 4 experts top-2 (renormalised).
_QWEN3_MOE_TEXT_TINY: dict[str, Any] = {
    **_QWEN3_TEXT_TINY,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}


def build_vl_tokenizer():
    """The demo BPE tokenizer as a ``Qwen2TokenizerFast`` (the class Qwen's VL processors require), with
    :data:`VISION_TOKENS` added as special tokens and :data:`VL_CHAT_TEMPLATE`."""
    import transformers

    base = build_tokenizer(vocab_size=512)
    tok = transformers.Qwen2TokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        unk_token=None,
    )
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = VL_CHAT_TEMPLATE
    return tok


def tiny_vl_config(arch: str, **text_overrides: Any) -> Any:
    """A tiny ``transformers`` config for ``arch`` "qwen2_vl" or "qwen2_5_vl" (text: hidden 64, 2 layers, GQA 4/2
    heads of dim 16, MRoPE sections [2, 3, 3]); ``text_overrides`` replace text-config fields. The special token ids
    are filled in by :func:`build_tiny_vl_model`."""
    import transformers

    if arch == "qwen2_vl":
        text = {**_TEXT_TINY, **text_overrides}
        return transformers.Qwen2VLConfig(text_config=text, vision_config=dict(QWEN2_VL_VISION_TINY))
    if arch == "qwen2_5_vl":
        text = {**_TEXT_TINY, **text_overrides}
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=dict(QWEN2_5_VL_VISION_TINY))
    if arch == "qwen3_vl":
        text = {**_QWEN3_TEXT_TINY, **text_overrides}
        return transformers.Qwen3VLConfig(text_config=text, vision_config=dict(QWEN3_VL_VISION_TINY))
    if arch == "qwen3_vl_moe":
        text = {**_QWEN3_MOE_TEXT_TINY, **text_overrides}
        return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=dict(QWEN3_VL_VISION_TINY))
    raise ValueError(
        f"tiny_vl_config: unknown arch {arch!r}; expected 'qwen2_vl', 'qwen2_5_vl', 'qwen3_vl' or 'qwen3_vl_moe'"
    )


def _processor(config: Any, tokenizer: Any) -> Any:
    import transformers

    vision = config.vision_config
    geometry = {
        "patch_size": vision.patch_size,
        "merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size,
    }
    scale = (vision.patch_size * vision.spatial_merge_size / 28) ** 2  # the bounds count merged cells
    image_px = tuple(int(p * scale) for p in IMAGE_PIXELS)
    video_px = tuple(int(p * scale) for p in VIDEO_PIXELS)
    qwen3 = config.model_type.startswith("qwen3")
    norm = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]} if qwen3 else {}
    image = transformers.Qwen2VLImageProcessor(
        size={"shortest_edge": image_px[0], "longest_edge": image_px[1]}, **geometry, **norm
    )
    video_cls = transformers.Qwen3VLVideoProcessor if qwen3 else transformers.Qwen2VLVideoProcessor
    video = video_cls(size={"shortest_edge": video_px[0], "longest_edge": video_px[1]}, **geometry, **norm)
    cls = {
        "qwen2_vl": transformers.Qwen2VLProcessor,
        "qwen2_5_vl": transformers.Qwen2_5_VLProcessor,
    }.get(config.model_type, transformers.Qwen3VLProcessor)
    return cls(image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=VL_CHAT_TEMPLATE)


def build_tiny_vl_model(
    config: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    std: float = 0.2,
    dtype: str = "float32",
) -> Path:
    """Save random weights for a tiny VL ``config`` (from :func:`tiny_vl_config`) and its processor; returns the dir.

    The text vocabulary grows to hold the vision tokens and the config's ``image_token_id`` / ``video_token_id`` /
    ``vision_start_token_id`` / ``vision_end_token_id`` point at them. Weights are drawn like
    :func:`npu_testkit.models.build_tiny_model` (matrices N(0, std), norm scales U(0.5, 1.5), the rest N(0, std/4)).
    """
    import transformers

    tokenizer = build_vl_tokenizer()
    text = config.text_config
    text.vocab_size = max(text.vocab_size, len(tokenizer))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config.vision_start_token_id = ids["<|vision_start|>"]
    config.vision_end_token_id = ids["<|vision_end|>"]
    config.image_token_id = ids["<|image_pad|>"]
    config.video_token_id = ids["<|video_pad|>"]
    for cfg in (config, text):
        cfg.bos_token_id = tokenizer.bos_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.torch_dtype = dtype
    key = _fingerprint(
        config.to_dict(), seed, std, f"vl:{IMAGE_PIXELS}:{VIDEO_PIXELS}:{VL_CHAT_TEMPLATE}:{VISION_TOKENS}"
    )
    return _save_random_checkpoint(
        config,
        key,
        path,
        transformers.AutoModelForImageTextToText,
        lambda: _processor(config, tokenizer),
        seed=seed,
        std=std,
        dtype=dtype,
    )


# --- synthetic media --------------------------------------------------------------------------------------------


def synthetic_image(width: int, height: int, seed: int = 0):
    """A deterministic RGB ``PIL.Image`` of ``width`` x ``height``: smooth gradients plus seeded noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def synthetic_video(frames: int, width: int, height: int, seed: int = 0):
    """A deterministic ``uint8`` video array ``[frames, height, width, 3]`` (a pattern drifting frame to frame)."""
    import numpy as np

    return np.stack([np.asarray(synthetic_image(width, height, seed=seed + i)).copy() for i in range(frames)], axis=0)


# --- the HF reference -------------------------------------------------------------------------------------------


def text_token_ids(model_dir: str | os.PathLike[str]) -> list[int]:
    """Every token id of the checkpoint's vocabulary except the :data:`VISION_TOKENS` (what the tests let models
    generate)."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    vision = {config[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")}
    return [i for i in range(config["text_config"]["vocab_size"]) if i not in vision]


def hf_vl_greedy(
    model_dir: str | os.PathLike[str], requests: list[dict[str, Any]], max_new_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """Greedy continuations from HF transformers float32, one request at a time (no padding effects).

    Each request is ``{"prompt": str, "multi_modal_data": {"image": PIL | [PIL, ...], "video": array | [...]}}``
    (vLLM's prompt shape; ``multi_modal_data`` optional). Returns ``(prompt_token_ids, generated_ids)`` per request,
    the prompt ids after the processor expanded the placeholders. The vision special tokens are never generated
    (their logits masked; give vLLM :func:`text_token_ids` as ``allowed_token_ids``): a generated placeholder
    would count as an image token in HF's next full forward.

    Every step is a full forward of the whole sequence (no KV cache): transformers 4.57's incremental ``generate``
    for Qwen2-VL with a video drifts from its own full forward (measured: log-probs off by 0.03-0.05 from the third
    token on, the argmax flipped at token 11), while the full forward is the model's definition.
    """
    import torch
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    banned = [i for i in range(model.config.text_config.vocab_size) if i not in set(text_token_ids(model_dir))]
    outputs = []
    with torch.no_grad():
        for req in requests:
            media = req.get("multi_modal_data") or {}
            images, videos = media.get("image"), media.get("video")
            kwargs: dict[str, Any] = {}
            if images is not None:
                kwargs["images"] = images if isinstance(images, list) else [images]
            if videos is not None:
                videos = videos if isinstance(videos, list) else [videos]
                if isinstance(videos[0], tuple):  # (frames, metadata): Qwen3-VL's timestamped video prompts
                    kwargs["video_metadata"] = [
                        transformers.video_utils.VideoMetadata(
                            **{k: v for k, v in m.items() if k != "do_sample_frames"}
                        )
                        for _, m in videos
                    ]
                    kwargs["do_sample_frames"] = False
                    videos = [v for v, _ in videos]
                kwargs["videos"] = videos
            inputs = dict(processor(text=[req["prompt"]], return_tensors="pt", **kwargs))
            prompt = inputs.pop("input_ids")
            inputs.pop("attention_mask", None)
            ids = prompt
            for _ in range(max_new_tokens):
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **inputs).logits
                last = logits[:, -1]
                last[:, banned] = float("-inf")
                ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
            outputs.append((prompt[0].tolist(), ids[0, prompt.shape[1] :].tolist()))
    return outputs


# --- requests ---------------------------------------------------------------------------------------------------

_PLACEHOLDER = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}


def chat_prompt(*parts: str) -> str:
    """One user turn plus the assistant header, as :data:`VL_CHAT_TEMPLATE` renders it: each part "image" /
    "video" becomes that item's placeholder (one per item, in order), any other part is text."""
    body = "".join(_PLACEHOLDER.get(p, p) for p in parts)
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def video_metadata(frames: int, fps: float = 2.0) -> dict[str, Any]:
    """vLLM's metadata dict of a video of ``frames`` frames at ``fps`` that were all kept (no resampling): what
    Qwen3-VL's processor needs to write the frames' timestamps into the prompt."""
    return {
        "total_num_frames": frames,
        "fps": fps,
        "duration": frames / fps,
        "frames_indices": list(range(frames)),
        "video_backend": "numpy",
        "do_sample_frames": False,
    }


def mixed_vl_requests(factor: int = 28, video: bool = True, metadata: bool = False) -> list[dict[str, Any]]:
    """The batch of the VL e2e tests, in vLLM's prompt shape (``prompt`` + ``multi_modal_data``):

    0. a small image (3x2 merged cells of ``factor`` pixels, e.g. 84x56 for Qwen2's 28: 6 LLM tokens),
    1. a larger image (5x4 cells, 20 tokens; wider than a Qwen2.5-VL window),
    2. a short video (4 frames of 3x2 cells: 2 temporal patches, 12 tokens),
    3. text only,
    4. both images and the video in one prompt with text between them (longer than one 32-token prefill chunk, so
       chunked prefill splits it inside a multimodal item).

    ``video=False`` leaves the video out (requests 2 and 4 lose it); ``metadata=True`` passes the video as
    ``(frames, video_metadata(...))`` (Qwen3-VL).
    """
    small, large = synthetic_image(3 * factor, 2 * factor, seed=1), synthetic_image(5 * factor, 4 * factor, seed=2)
    clip: Any = synthetic_video(4, 3 * factor, 2 * factor, seed=3)
    if metadata:
        clip = (clip, video_metadata(4))
    if not video:
        return [
            {"prompt": chat_prompt("image", "What is in the picture?"), "multi_modal_data": {"image": small}},
            {"prompt": chat_prompt("image", "Describe this image."), "multi_modal_data": {"image": large}},
            {"prompt": chat_prompt("Four score and seven years ago")},
            {
                "prompt": chat_prompt("image", "and", "image", "compare them, please, in some detail."),
                "multi_modal_data": {"image": [large, small]},
            },
        ]
    return [
        {"prompt": chat_prompt("image", "What is in the picture?"), "multi_modal_data": {"image": small}},
        {"prompt": chat_prompt("image", "Describe this image."), "multi_modal_data": {"image": large}},
        {"prompt": chat_prompt("video", "What happens here?"), "multi_modal_data": {"video": clip}},
        {"prompt": chat_prompt("Four score and seven years ago")},
        {
            "prompt": chat_prompt("image", "and", "image", "then the clip", "video", "compare them."),
            "multi_modal_data": {"image": [large, small], "video": clip},
        },
    ]
