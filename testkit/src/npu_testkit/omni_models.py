# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""A tiny Qwen2.5-Omni checkpoint built on the fly (no hub downloads), synthetic audio, and the HF thinker reference.

``build_tiny_omni_model()`` saves a ``Qwen2_5OmniForConditionalGeneration`` with ``enable_audio_output=False`` (the
thinker only: its weights under ``thinker.``, as the released checkpoints store them; vLLM 0.11 serves the thinker
and skips ``talker.`` / ``token2wav.``) and a locally assembled ``Qwen2_5OmniProcessor``: the demo BPE tokenizer as
a ``Qwen2TokenizerFast`` with the Omni special tokens (:data:`OMNI_TOKENS`, named for the processor through
``extra_special_tokens``), a Qwen2-VL image and video processor sized for tiny media, and a ``WhisperFeatureExtractor``
with 16 mel bins and 2-second windows (so vLLM's profiling item stays small). vLLM and HF load the same directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .models import _fingerprint, _save_random_checkpoint, build_tokenizer
from .vl_models import IMAGE_PIXELS, VIDEO_PIXELS

#: The Omni special tokens, in the order their ids follow the text vocabulary, and the processor attribute of each.
#: The vision brackets are named as vLLM's chat placeholder writes them (``<|vision_start|>``).
OMNI_TOKENS = {
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
}

#: ChatML with Omni content parts (image / video / audio placeholders, one per item; text as is).
OMNI_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|IMAGE|><|vision_end|>"
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}<|vision_start|><|VIDEO|><|vision_end|>"
    "{% elif part['type'] == 'audio' or part['type'] == 'input_audio' or part['type'] == 'audio_url' %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SAMPLING_RATE = 16000
MEL_BINS = 16
#: The feature extractor's window (seconds): audio is padded to it, and it bounds one item.
AUDIO_CHUNK_SECONDS = 2

_TEXT: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "default", "type": "default", "mrope_section": [2, 3, 3]},
    "tie_word_embeddings": False,
}

#: The Qwen2.5-VL tower of the released thinker in miniature: 3 blocks (block 1 full attention, 0 and 2 windowed),
#: 2 heads of dim 80 (padded to 128 by the NPU override), 14-pixel patches merged 2x2.
_VISION: dict[str, Any] = {
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
    # = the thinker's position_id_per_seconds (25), as in the released config: HF's get_rope_index times videos by
    # the latter, vLLM's _omni_get_input_positions_tensor by this one.
    "tokens_per_second": 25,
}

#: The Whisper-style audio encoder: 2 layers, width 32, 2 heads, 16 mel bins, attention windows of 2 * 50 frames.
_AUDIO: dict[str, Any] = {
    "num_mel_bins": MEL_BINS,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "d_model": 32,
    "output_dim": 64,
    "n_window": 50,
    "max_source_positions": 200,
}


def build_omni_tokenizer():
    """The demo BPE tokenizer as a ``Qwen2TokenizerFast`` with :data:`OMNI_TOKENS` as special tokens, each named
    for the processor (``tokenizer.image_token`` ...), and :data:`OMNI_CHAT_TEMPLATE`."""
    import transformers

    base = build_tokenizer(vocab_size=512)
    tok = transformers.Qwen2TokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        unk_token=None,
        extra_special_tokens=dict(OMNI_TOKENS),
    )
    tok.add_special_tokens({"additional_special_tokens": list(OMNI_TOKENS.values())})
    tok.chat_template = OMNI_CHAT_TEMPLATE
    return tok


def tiny_omni_config() -> Any:
    """A tiny ``Qwen2_5OmniConfig`` (thinker only, ``enable_audio_output=False``); token ids are filled in by
    :func:`build_tiny_omni_model`."""
    import transformers

    thinker = transformers.Qwen2_5OmniThinkerConfig(
        text_config=dict(_TEXT), vision_config=dict(_VISION), audio_config=dict(_AUDIO)
    )
    config = transformers.Qwen2_5OmniConfig(thinker_config=thinker.to_dict(), enable_audio_output=False)
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    return config


def _processor(config: Any, tokenizer: Any) -> Any:
    import transformers

    vision = config.thinker_config.vision_config
    geometry = {
        "patch_size": vision.patch_size,
        "merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size,
    }
    image = transformers.Qwen2VLImageProcessor(
        size={"shortest_edge": IMAGE_PIXELS[0], "longest_edge": IMAGE_PIXELS[1]}, **geometry
    )
    video = transformers.Qwen2VLVideoProcessor(
        size={"shortest_edge": VIDEO_PIXELS[0], "longest_edge": VIDEO_PIXELS[1]}, **geometry
    )
    audio = transformers.WhisperFeatureExtractor(
        feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE, chunk_length=AUDIO_CHUNK_SECONDS
    )
    return _MergedPreprocessorConfig(
        transformers.Qwen2_5OmniProcessor(
            image_processor=image,
            video_processor=video,
            feature_extractor=audio,
            tokenizer=tokenizer,
            chat_template=OMNI_CHAT_TEMPLATE,
        )
    )


class _MergedPreprocessorConfig:
    """Saves an Omni processor the way the released checkpoints store it: the image processor and the feature
    extractor both live in ``preprocessor_config.json`` (transformers 4.57 writes each there in turn, the second
    overwriting the first), so the image processor's keys are merged back into the file."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def save_pretrained(self, out: str | os.PathLike[str]) -> None:
        import json

        self.processor.save_pretrained(out)
        path = Path(out) / "preprocessor_config.json"
        merged = {**json.loads(path.read_text()), **self.processor.image_processor.to_dict()}
        merged["processor_class"] = "Qwen2_5OmniProcessor"
        path.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")


class _OmniFactory:
    """``from_config`` for :func:`npu_testkit.models.write_random_checkpoint` (the Omni class has no Auto class)."""

    @staticmethod
    def from_config(config: Any, dtype: Any) -> Any:
        import transformers

        return transformers.Qwen2_5OmniForConditionalGeneration._from_config(config, dtype=dtype)


def build_tiny_omni_model(
    path: str | os.PathLike[str] | None = None, *, seed: int = 0, std: float = 0.2, dtype: str = "float32"
) -> Path:
    """Save random weights for :func:`tiny_omni_config` and its processor; returns the dir (cached by content)."""
    config = tiny_omni_config()
    tokenizer = build_omni_tokenizer()
    thinker = config.thinker_config
    thinker.text_config.vocab_size = max(thinker.text_config.vocab_size, len(tokenizer))
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in OMNI_TOKENS.items()}
    thinker.audio_token_index = ids["audio_token"]
    thinker.image_token_index = ids["image_token"]
    thinker.video_token_index = ids["video_token"]
    thinker.audio_start_token_id = ids["audio_bos_token"]
    thinker.audio_end_token_id = ids["audio_eos_token"]
    thinker.vision_start_token_id = ids["vision_bos_token"]
    thinker.vision_end_token_id = ids["vision_eos_token"]
    thinker.user_token_id = tokenizer.convert_tokens_to_ids("user") or 0
    for cfg in (config, thinker, thinker.text_config):
        cfg.bos_token_id = tokenizer.bos_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.torch_dtype = dtype
    key = _fingerprint(config.to_dict(), seed, std, f"omni:{IMAGE_PIXELS}:{OMNI_CHAT_TEMPLATE}:{OMNI_TOKENS}")
    return _save_random_checkpoint(
        config, key, path, _OmniFactory, lambda: _processor(config, tokenizer), seed=seed, std=std, dtype=dtype
    )


# --- media and prompts --------------------------------------------------------------------------------------------


def synthetic_audio(seconds: float, seed: int = 0):
    """A deterministic mono float32 waveform at :data:`SAMPLING_RATE`: two tones plus seeded noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    wave = 0.4 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + 0.2 * np.sin(2 * np.pi * 1330 * t)
    return (wave + rng.normal(0, 0.05, t.shape)).astype(np.float32)


_PLACEHOLDER = {
    "image": "<|vision_start|><|IMAGE|><|vision_end|>",
    "video": "<|vision_start|><|VIDEO|><|vision_end|>",
    "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
}


def omni_prompt(*parts: str) -> str:
    """One user turn plus the assistant header as :data:`OMNI_CHAT_TEMPLATE` renders it: each part "image" /
    "video" / "audio" becomes that item's placeholder, any other part is text."""
    body = "".join(_PLACEHOLDER.get(p, p) for p in parts)
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def omni_token_ids(model_dir: str | os.PathLike[str]) -> list[int]:
    """Every token id of the vocabulary except the :data:`OMNI_TOKENS` (what the tests let the models generate)."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())["thinker_config"]
    special = {
        config[k]
        for k in (
            "audio_token_index",
            "image_token_index",
            "video_token_index",
            "audio_start_token_id",
            "audio_end_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        )
    }
    return [i for i in range(config["text_config"]["vocab_size"]) if i not in special]


def _hf_thinker(model_dir: str | os.PathLike[str]) -> Any:
    """HF's thinker float32 with the checkpoint's ``thinker.`` weights (``Qwen2_5OmniForConditionalGeneration
    .from_pretrained`` would also want the talker's speaker file, which a thinker-only checkpoint lacks)."""
    import torch
    import transformers
    from safetensors.torch import load_file

    config = transformers.Qwen2_5OmniConfig.from_pretrained(model_dir).thinker_config
    thinker = transformers.Qwen2_5OmniThinkerForConditionalGeneration._from_config(config, dtype=torch.float32)
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    state = {k.removeprefix("thinker."): v.float() for k, v in weights.items() if k.startswith("thinker.")}
    missing, unexpected = thinker.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"tiny Omni thinker weights do not fit: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return thinker.eval()


def hf_omni_greedy(
    model_dir: str | os.PathLike[str], requests: list[dict[str, Any]], max_new_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """Greedy continuations of HF's thinker float32, one request at a time, a full forward per step (no KV cache,
    like :func:`npu_testkit.vl_models.hf_vl_greedy`); special tokens masked. ``requests`` in vLLM's shape
    (``multi_modal_data`` with "image" / "video" / "audio" (waveform, or ``(waveform, rate)``), single or lists).
    Returns ``(prompt_token_ids, generated_ids)`` per request."""
    import torch
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    thinker = _hf_thinker(model_dir)
    allowed = set(omni_token_ids(model_dir))
    banned = [i for i in range(thinker.config.text_config.vocab_size) if i not in allowed]
    outputs = []
    with torch.no_grad():
        for req in requests:
            media = req.get("multi_modal_data") or {}
            kwargs: dict[str, Any] = {}
            for key, arg in (("image", "images"), ("video", "videos"), ("audio", "audio")):
                items = media.get(key)
                if items is None:
                    continue
                items = items if isinstance(items, list) else [items]
                kwargs[arg] = [a[0] if isinstance(a, tuple) else a for a in items] if key == "audio" else items
            inputs = dict(processor(text=[req["prompt"]], return_tensors="pt", **kwargs))
            prompt = inputs.pop("input_ids")
            inputs.pop("attention_mask", None)
            ids = prompt
            for _ in range(max_new_tokens):
                logits = thinker(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **inputs).logits
                last = logits[:, -1]
                last[:, banned] = float("-inf")
                ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
            outputs.append((prompt[0].tolist(), ids[0, prompt.shape[1] :].tolist()))
    return outputs
