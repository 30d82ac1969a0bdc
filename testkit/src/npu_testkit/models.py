# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Tiny Hugging Face checkpoints built on the fly (no hub downloads), and HF reference generation.

``build_tiny_model(path, config)`` saves random weights for any ``transformers`` config plus a small byte-level BPE
tokenizer trained on bundled text, so that vLLM and HF load the very same checkpoint. Builds are cached by content:
calling it again with the same config and seed is free.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cache import cached_build


def default_cache_dir() -> Path:
    root = os.environ.get("NPU_TESTKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vllm-npu-tests"
    )
    return Path(root)


def build_tokenizer(vocab_size: int = 512):
    """The demo's byte-level BPE tokenizer (trained on the platform's bundled corpus), with a chat template."""
    from vllm_npu.platform.tools.demo.checkpoint import build_tokenizer as _build
    from vllm_npu.platform.tools.demo.checkpoint import corpus

    return _build(corpus(), vocab_size=vocab_size)


def _fingerprint(config_dict: dict[str, Any], seed: int, std: float, extra: str) -> str:
    blob = json.dumps(
        {"config": config_dict, "seed": seed, "std": std, "extra": extra, "tokenizer": "demo-bpe-v1"},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_tiny_model(
    config: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    std: float = 0.2,
    dtype: str = "float32",
    auto_class: str = "AutoModelForCausalLM",
) -> Path:
    """Save a randomly initialised model for ``config`` (a ``transformers.PretrainedConfig``) and a tokenizer.

    ``std`` is the init std of every weight matrix (large enough that greedy decoding is not degenerate).
    Returns the checkpoint directory. Rebuilding the same config is skipped (a ``.complete`` marker).
    """
    import transformers

    tokenizer = build_tokenizer(vocab_size=min(getattr(config, "vocab_size", 512), 512))
    config.vocab_size = max(getattr(config, "vocab_size", 0), len(tokenizer))
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.torch_dtype = dtype
    if hasattr(config, "initializer_range"):
        config.initializer_range = std
    key = _fingerprint(config.to_dict(), seed, std, auto_class)
    return _save_random_checkpoint(
        config, key, path, getattr(transformers, auto_class), lambda: tokenizer, seed=seed, std=std, dtype=dtype
    )


def _save_random_checkpoint(
    config: Any,
    key: str,
    path: str | os.PathLike[str] | None,
    model_class: Any,
    make_processor: Callable[[], Any],
    *,
    seed: int,
    std: float,
    dtype: str,
) -> Path:
    """:func:`write_random_checkpoint` into ``path`` or the cache dir named by ``key``, through the build cache
    (:func:`.cache.cached_build`): a dir whose ``.complete`` marker holds ``key`` is returned as it is."""
    out = Path(path) if path is not None else default_cache_dir() / f"{config.model_type}-{key}"
    return cached_build(
        out,
        key,
        lambda d: write_random_checkpoint(config, d, model_class, make_processor, seed=seed, std=std, dtype=dtype),
    )


def write_random_checkpoint(
    config: Any,
    out: Path,
    model_class: Any,
    make_processor: Callable[[], Any],
    *,
    seed: int,
    std: float,
    dtype: str,
) -> None:
    """Build ``model_class`` from ``config`` with seeded random weights and save it, then what ``make_processor()``
    returns (anything with ``save_pretrained``), to the directory ``out``. Matrices are drawn N(0, std), norm
    scales U(0.5, 1.5), the rest N(0, std/4)."""
    import torch

    torch.manual_seed(seed)
    model = model_class.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
            elif "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, std / 4)
    model.save_pretrained(out, safe_serialization=True)
    make_processor().save_pretrained(out)


def hf_greedy(
    model_dir: str | os.PathLike[str],
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: str = "float32",
    attn_implementation: str | None = None,
) -> list[list[int]]:
    """Greedy continuations from HF transformers (the reference), one prompt at a time (no padding effects).

    ``attn_implementation`` picks HF's attention code (e.g. "eager", the one that applies Gemma-2's soft-cap);
    None keeps transformers' default."""
    import torch
    from transformers import AutoModelForCausalLM

    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **extra)
    model.eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            inp = torch.tensor([ids])
            gen = model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=model.config.pad_token_id,
            )
            outputs.append(gen[0, len(ids) :].tolist())
    return outputs


def hf_logprobs(model_dir: str | os.PathLike[str], ids: list[int], dtype: str = "float32"):
    """HF log-softmax over the vocabulary for every position of ``ids``: a ``[len(ids), vocab]`` float tensor."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
