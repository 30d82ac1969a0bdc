# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""C8 calibration for ``vllm-npu quantize --kv-cache C8``: per-channel K/V scales of every attention layer.

The int8 cache stores the keys after RoPE and the values, so the statistics are taken where the HF attention
function receives them (``key_states`` / ``value_states`` ``[B, Nkv, S, D]``, keys already rotated): a recording
attention implementation, registered with transformers' ``AttentionInterface``, keeps each layer's per-channel
``max |x|`` over the calibration prompts and hands the call on to SDPA. ``scale = max|x| / 127`` per channel
(symmetric; a channel never seen non-zero gets the smallest positive scale, so every scale is > 0).

The checkpoint gets msModelSlim's spelling ("KV Cache int8" in the MindIE docs): ``kv_cache_type: "C8"`` and, per
layer, ``<block>.k_proj.kv_cache_scale`` / ``kv_cache_offset`` (zero: symmetric) and the same for ``v_proj``,
``[Nkv * D]`` in the checkpoint dtype, typed in the description like the model's linear scheme.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .quantize_paths import QuantizeError

KV_CACHE_SCHEMES = ("C8",)
_ATTN_NAME = "npu_c8_calibration"
#: The smallest scale written (a channel that is zero on every calibration token).
MIN_SCALE = 1e-6


@torch.no_grad()
def calibrate_kv(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
    """``{"<block>.k_proj.kv_cache_scale": [Nkv * D], "<block>.v_proj.kv_cache_scale": ...}`` (float32) for every
    attention block (the module whose forward calls the attention function, e.g. ``model.layers.0.self_attn``)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    names = {id(m): n for n, m in model.named_modules()}
    stats: dict[str, list[torch.Tensor]] = {}

    def record(
        module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any
    ):
        block = names[id(module)]
        k = key.detach().float().abs().amax(dim=(0, 2))  # [Nkv, D]
        v = value.detach().float().abs().amax(dim=(0, 2))
        cur = stats.get(block)
        stats[block] = [k, v] if cur is None else [torch.maximum(cur[0], k), torch.maximum(cur[1], v)]
        return sdpa_attention_forward(module, query, key, value, *a, **kw)

    AttentionInterface.register(_ATTN_NAME, record)
    config: Any = model.config  # a transformers PretrainedConfig (nn.Module types attributes as Tensor | Module)
    before = config._attn_implementation
    config._attn_implementation = _ATTN_NAME
    try:
        for prompt in prompts:
            model(tokenizer(prompt, return_tensors="pt").input_ids)
    finally:
        config._attn_implementation = before
    if not stats:
        raise QuantizeError("C8 calibration saw no attention layer: the model's attention does not use transformers' "
                            "attention interface")  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for block, (k, v) in stats.items():
        for proj, amax in (("k_proj", k), ("v_proj", v)):
            out[f"{block}.{proj}.kv_cache_scale"] = (amax.reshape(-1) / 127).clamp_min(MIN_SCALE)
    return out


def c8_tensors(scales: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors: each scale in ``dtype`` (msModelSlim writes the model dtype; a calibrated maximum a
    rounded-down scale no longer reaches saturates at +-127) and a zero ``kv_cache_offset`` beside it."""
    out: dict[str, torch.Tensor] = {}
    for name, scale in scales.items():
        stored = scale.to(dtype).contiguous()
        out[name] = stored
        out[name.replace("kv_cache_scale", "kv_cache_offset")] = torch.zeros_like(stored)
    return out
