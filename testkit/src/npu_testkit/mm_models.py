# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Tiny multimodal checkpoints of the families beyond Qwen-VL, built on the fly with their real transformers
processors (no hub downloads): Gemma-3 (SigLIP tower, sliding-window + global text layers) and Qwen2-Audio
(Whisper-style audio encoder); plus the HF greedy reference for them.

Tokenizers are the demo byte-level BPE one (:func:`npu_testkit.models.build_tokenizer`) with each family's special
tokens named for its processor through ``extra_special_tokens``. Builds are cached by content like
:func:`npu_testkit.models.build_tiny_model`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .models import _fingerprint, _save_random_checkpoint, build_tokenizer

# --- Gemma-3 ----------------------------------------------------------------------------------------------------

#: Gemma-3's image tokens (processor attribute -> token).
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
#: Newline runs Gemma's SentencePiece vocabulary has as single tokens; vLLM's Gemma-3 processor looks them up by their
#: literal text (``vocab["\n\n"]``), which a byte-level vocabulary spells differently: added as tokens of their own.
NEWLINES = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
#: Gemma's turn markers (special tokens of their own in its vocabulary).
GEMMA3_TURNS = ("<start_of_turn>", "<end_of_turn>")
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
#: Image side in pixels and tokens per image: a 56x56 SigLIP input (4x4 patches of 14) pooled to 2x2 = 4 tokens.
GEMMA3_IMAGE_SIZE, GEMMA3_IMAGE_TOKENS = 56, 4


def tiny_gemma3_config(**text_overrides: Any) -> Any:
    """A tiny ``Gemma3Config``: text hidden 64, 2 layers (sliding window 24, then global), GQA 4/2 heads of dim 16;
    SigLIP width 32, 2 layers, 2 heads; 4 tokens per image. Token ids are filled in by :func:`build_tiny_gemma3_model`."""
    import transformers

    text = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 1024,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rms_norm_eps": 1e-6,
        **text_overrides,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": GEMMA3_IMAGE_SIZE,
        "patch_size": 14,
        "vision_use_head": False,
    }
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_IMAGE_TOKENS)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    return config


def _family_tokenizer(
    cls_name: str, names: dict[str, str], template: str, extra: tuple[str, ...] = (), specials: tuple[str, ...] = ()
) -> Any:
    import transformers
    from tokenizers import AddedToken

    base = build_tokenizer(vocab_size=512)
    tok = getattr(transformers, cls_name)(
        tokenizer_object=base.backend_tokenizer,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        unk_token=None,
        extra_special_tokens=dict(names),
    )
    tok.add_special_tokens({"additional_special_tokens": [*names.values(), *specials]})
    if extra:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in extra])
    tok.chat_template = template
    return tok


def build_tiny_gemma3_model(
    config: Any = None, path: str | os.PathLike[str] | None = None, *, seed: int = 0, std: float = 0.2
) -> Path:
    """Save random weights for a tiny Gemma-3 (default :func:`tiny_gemma3_config`) and its ``Gemma3Processor``
    (``Gemma3ImageProcessor`` at 56x56, pan-and-scan off); returns the dir."""
    import transformers

    config = config or tiny_gemma3_config()
    tok = _family_tokenizer("GemmaTokenizerFast", GEMMA3_TOKENS, GEMMA3_CHAT_TEMPLATE, NEWLINES, GEMMA3_TURNS)
    config.text_config.vocab_size = max(config.text_config.vocab_size, len(tok))
    config.boi_token_index = tok.convert_tokens_to_ids(GEMMA3_TOKENS["boi_token"])
    config.eoi_token_index = tok.convert_tokens_to_ids(GEMMA3_TOKENS["eoi_token"])
    config.image_token_index = tok.convert_tokens_to_ids(GEMMA3_TOKENS["image_token"])
    for cfg in (config, config.text_config):
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        cfg.torch_dtype = "float32"

    def processor() -> Any:
        image = transformers.Gemma3ImageProcessor(
            size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE}, do_pan_and_scan=False
        )
        return transformers.Gemma3Processor(
            image_processor=image,
            tokenizer=tok,
            chat_template=GEMMA3_CHAT_TEMPLATE,
            image_seq_length=GEMMA3_IMAGE_TOKENS,
        )

    key = _fingerprint(config.to_dict(), seed, std, f"gemma3:{GEMMA3_TOKENS}:{NEWLINES}:{GEMMA3_CHAT_TEMPLATE}")
    return _save_random_checkpoint(
        config,
        key,
        path,
        transformers.AutoModelForImageTextToText,
        processor,
        seed=seed,
        std=std,
        dtype="float32",
    )


def gemma3_prompt(*parts: str) -> str:
    """One user turn plus the model header as :data:`GEMMA3_CHAT_TEMPLATE` renders it, without the bos token (the
    tokenizer adds it); "image" parts become the image's begin token, which the processor expands."""
    body = "".join(GEMMA3_TOKENS["boi_token"] if p == "image" else p for p in parts)
    return f"<start_of_turn>user\n{body}<end_of_turn>\n<start_of_turn>model\n"


# --- the HF reference -------------------------------------------------------------------------------------------


def special_ids(model_dir: str | os.PathLike[str]) -> set[int]:
    """The ids of the tokenizer's additional special tokens (never generated in the tests)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return {tok.convert_tokens_to_ids(t) for t in tok.additional_special_tokens}


def hf_mm_greedy(
    model: Any,
    processor: Any,
    requests: list[dict[str, Any]],
    max_new_tokens: int,
    banned: set[int],
    drop: tuple[str, ...] = (),
    audio_arg: str = "audio",
) -> list[tuple[list[int], list[int]]]:
    """Greedy continuations of an HF multimodal ``model`` float32, one request at a time, a full forward per step
    (no KV cache); ``banned`` ids masked. ``requests`` in vLLM's shape (``multi_modal_data`` "image" / "audio",
    single or lists; audio goes to the processor's ``audio_arg``); ``drop`` names processor outputs not passed to the
    model. Returns ``(prompt_ids, generated)``."""
    import torch

    outputs = []
    with torch.no_grad():
        for req in requests:
            media = req.get("multi_modal_data") or {}
            kwargs: dict[str, Any] = {}
            for key, arg in (("image", "images"), ("audio", audio_arg)):
                items = media.get(key)
                if items is not None:
                    kwargs[arg] = items if isinstance(items, list) else [items]
                    if key == "audio":
                        kwargs["sampling_rate"] = SAMPLING_RATE
            inputs = dict(processor(text=[req["prompt"]], return_tensors="pt", **kwargs))
            prompt = inputs.pop("input_ids")
            inputs.pop("attention_mask", None)
            for name in drop:
                inputs.pop(name, None)
            ids = prompt
            for _ in range(max_new_tokens):
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **inputs).logits
                last = logits[:, -1].clone()
                last[:, sorted(banned)] = float("-inf")
                ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
            outputs.append((prompt[0].tolist(), ids[0, prompt.shape[1] :].tolist()))
    return outputs


# --- Qwen2-Audio ------------------------------------------------------------------------------------------------

#: Qwen2-Audio's audio tokens (processor attribute -> token).
QWEN2_AUDIO_TOKENS = {
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "audio_token": "<|AUDIO|>",
}
QWEN2_AUDIO_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' or part['type'] == 'input_audio' or part['type'] == 'audio_url' %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: 16 mel bins, Whisper's 30-second window (3000 frames, the encoder's 1500 positions after its stride-2 conv): vLLM
#: 0.11's ``Qwen2AudioInputs`` schema fixes the features at 3000 frames.
AUDIO_MEL_BINS, AUDIO_SECONDS, SAMPLING_RATE = 16, 30, 16000


def tiny_qwen2_audio_config() -> Any:
    """A tiny ``Qwen2AudioConfig``: Qwen2 text hidden 64, 2 layers, GQA 4/2; audio encoder width 32, 2 layers, 2
    heads, 16 mel bins, 1500 positions. The audio token id is filled in by :func:`build_tiny_qwen2_audio_model`."""
    import transformers

    text = {
        "model_type": "qwen2",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    audio = {
        "num_mel_bins": AUDIO_MEL_BINS,
        "encoder_layers": 2,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "max_source_positions": AUDIO_SECONDS * 50,
    }
    config = transformers.Qwen2AudioConfig(audio_config=audio, text_config=text)
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    return config


class _Qwen2AudioFactory:
    """``from_config`` for :func:`npu_testkit.models.write_random_checkpoint` (no Auto class builds Qwen2-Audio)."""

    @staticmethod
    def from_config(config: Any, dtype: Any) -> Any:
        import transformers

        return transformers.Qwen2AudioForConditionalGeneration._from_config(config, dtype=dtype)


def build_tiny_qwen2_audio_model(
    path: str | os.PathLike[str] | None = None, *, seed: int = 0, std: float = 0.2
) -> Path:
    """Save random weights for :func:`tiny_qwen2_audio_config` and its ``Qwen2AudioProcessor`` (Whisper feature
    extractor at 16 mel bins, 30-second windows); returns the dir."""
    import transformers

    config = tiny_qwen2_audio_config()
    tok = _family_tokenizer("Qwen2TokenizerFast", QWEN2_AUDIO_TOKENS, QWEN2_AUDIO_CHAT_TEMPLATE)
    config.text_config.vocab_size = max(config.text_config.vocab_size, len(tok))
    config.audio_token_index = tok.convert_tokens_to_ids(QWEN2_AUDIO_TOKENS["audio_token"])
    for cfg in (config, config.text_config):
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        cfg.torch_dtype = "float32"

    def processor() -> Any:
        features = transformers.WhisperFeatureExtractor(
            feature_size=AUDIO_MEL_BINS, sampling_rate=SAMPLING_RATE, chunk_length=AUDIO_SECONDS
        )
        return transformers.Qwen2AudioProcessor(
            feature_extractor=features, tokenizer=tok, chat_template=QWEN2_AUDIO_CHAT_TEMPLATE
        )

    key = _fingerprint(config.to_dict(), seed, std, f"qwen2_audio:{QWEN2_AUDIO_TOKENS}:{QWEN2_AUDIO_CHAT_TEMPLATE}")
    return _save_random_checkpoint(
        config, key, path, _Qwen2AudioFactory, processor, seed=seed, std=std, dtype="float32"
    )


def qwen2_audio_prompt(*parts: str, brackets: bool = True) -> str:
    """One user turn plus the assistant header as :data:`QWEN2_AUDIO_CHAT_TEMPLATE` renders it ("audio" parts
    become the item's placeholder).

    ``brackets=False`` writes the bare ``<|AUDIO|>`` instead: vLLM 0.11's Qwen2-Audio prompt update replaces that
    token by ``<|audio_bos|>`` + the audio's tokens + ``<|audio_eos|>`` whenever it applies the update itself (its
    processor-cache path, the default), so a bracketed prompt gets the brackets twice there; HF's processor expands
    only the ``<|AUDIO|>`` of a bracketed prompt. Both give the same token ids."""
    audio = "<|audio_bos|><|AUDIO|><|audio_eos|>" if brackets else "<|AUDIO|>"
    body = "".join(audio if p == "audio" else p for p in parts)
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


# --- InternVL (transformers format) -------------------------------------------------------------------------------

#: InternVL's image tokens (tokenizer attribute -> token); prompts carry one ``<IMG_CONTEXT>`` per image, which the
#: processor expands to ``<img>`` + the image's tiles' tokens + ``</img>``.
INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<IMG_CONTEXT>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Tile side (pixels) and tokens per tile: 56x56 tiles, 4x4 patches of 14, pixel-shuffled by 0.5 to 2x2 = 4 tokens.
#: Images are cut into up to 4 tiles (plus a thumbnail when more than one), so two sizes give different counts.
INTERNVL_TILE, INTERNVL_TILE_TOKENS, INTERNVL_MAX_TILES = 56, 4, 4


def tiny_internvl_config() -> Any:
    """A tiny ``InternVLConfig`` (transformers format, ``InternVLForConditionalGeneration``): InternViT width 32,
    2 layers, 2 heads, 56-pixel tiles; Qwen2 text hidden 64, 2 layers, GQA 4/2; pixel shuffle 0.5."""
    import transformers

    text = {
        "model_type": "qwen2",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": [INTERNVL_TILE, INTERNVL_TILE],
        "patch_size": [14, 14],
    }
    config = transformers.InternVLConfig(vision_config=vision, text_config=text, downsample_ratio=0.5)
    config.architectures = ["InternVLForConditionalGeneration"]
    config.text_config.architectures = ["Qwen2ForCausalLM"]  # vLLM builds the language model by this name
    return config


def internvl_tokenizer_and_processor(config: Any) -> Callable[[], Any]:
    """Fit the tiny transformers-format InternVL ``config`` (vocabulary size, image token id, special token ids,
    float32) to its Qwen2 tokenizer with the InternVL tokens and chat template, and return the factory of its
    ``InternVLProcessor`` (GOT-OCR2 image processor tiling into up to :data:`INTERNVL_MAX_TILES` tiles)."""
    import transformers

    tok = _family_tokenizer("Qwen2TokenizerFast", INTERNVL_TOKENS, INTERNVL_CHAT_TEMPLATE)
    config.text_config.vocab_size = max(config.text_config.vocab_size, len(tok))
    config.image_token_id = tok.convert_tokens_to_ids(INTERNVL_TOKENS["context_image_token"])
    for cfg in (config, config.text_config):
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        cfg.torch_dtype = "float32"

    def processor() -> Any:
        size = {"height": INTERNVL_TILE, "width": INTERNVL_TILE}
        image = transformers.GotOcr2ImageProcessorFast(
            size=size, crop_to_patches=True, min_patches=1, max_patches=INTERNVL_MAX_TILES
        )
        video = transformers.InternVLVideoProcessor(size=size)
        return transformers.InternVLProcessor(
            image_processor=image,
            tokenizer=tok,
            video_processor=video,
            image_seq_length=INTERNVL_TILE_TOKENS,
            chat_template=INTERNVL_CHAT_TEMPLATE,
        )

    return processor


def build_tiny_internvl_model(path: str | os.PathLike[str] | None = None, *, seed: int = 0, std: float = 0.2) -> Path:
    """Save random weights for :func:`tiny_internvl_config` and its ``InternVLProcessor`` (GOT-OCR2 image processor
    tiling into up to 4 tiles of 56 pixels); returns the dir."""
    import transformers

    config = tiny_internvl_config()
    processor = internvl_tokenizer_and_processor(config)

    key = _fingerprint(config.to_dict(), seed, std, f"internvl:{INTERNVL_TOKENS}:{INTERNVL_CHAT_TEMPLATE}")
    return _save_random_checkpoint(
        config,
        key,
        path,
        transformers.AutoModelForImageTextToText,
        processor,
        seed=seed,
        std=std,
        dtype="float32",
    )


def internvl_prompt(*parts: str) -> str:
    """One user turn plus the assistant header as :data:`INTERNVL_CHAT_TEMPLATE` renders it ("image" parts become
    ``<IMG_CONTEXT>`` and a newline)."""
    body = "".join("<IMG_CONTEXT>\n" if p == "image" else p for p in parts)
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"
