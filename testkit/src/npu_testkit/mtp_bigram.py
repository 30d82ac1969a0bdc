# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""An MTP layer that drafts from a bigram table, for engine tests that need accepted drafts from a tiny DeepSeek-V3.

:func:`npu_testkit.drafts.build_mtp_model` gives the MTP layer random weights, so its drafts are almost never
accepted and every verification step rejects. :func:`teach_bigrams` rewrites the FLOAT parts of a checkpoint's MTP
layer (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head``) so that the draft for position
``t + 2`` depends on the token at ``t + 1`` only, through a table read off known greedy continuations:

- ``eh_proj = [I, 0]`` keeps only the normed embedding of the input token and ``enorm`` scales it by ``SCALE``:
  the MTP decoder block adds its (input-normed, so bounded) output to a residual that dwarfs it;
- ``shared_head.norm`` is 1 and ``shared_head.head`` row ``b`` is the sum of the unit-RMS embeddings of the tokens
  ``a`` that precede ``b`` in the continuations, so ``argmax`` gives ``b`` for ``a`` (random embeddings of a tiny
  model are near-orthogonal; a token with two successors keeps the first).

The target's weights are untouched (its tokens and any reference computed from them stay valid); the decoder block
of the MTP layer (quantized or not) still runs, so the draft's attention, MoE and their dispatch are exercised.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

SCALE = 100.0


def bigrams(prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> dict[int, int]:
    """``a -> b`` for each consecutive pair of the greedy continuations, the prompt's last token included (first
    successor kept)."""
    table: dict[int, int] = {}
    for prompt, out in zip(prompts, continuations, strict=True):
        seq = [prompt[-1], *out]
        for a, b in zip(seq, seq[1:]):
            table.setdefault(a, b)
    return table


def teach_bigrams(checkpoint: Path, table: dict[int, int]) -> None:
    """Rewrite the MTP layer of the DeepSeek-V3 ``checkpoint`` (one MTP layer, ``num_nextn_predict_layers = 1``; its
    safetensors shard(s) rewritten in place) to draft ``table[a]`` after token ``a``."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((checkpoint / "config.json").read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    eps = float(config.get("rms_norm_eps", 1e-6))
    for shard in sorted(checkpoint.glob("*.safetensors")):
        state = load_file(str(shard))
        if prefix + "eh_proj.weight" not in state:
            continue
        embed = state[prefix + "embed_tokens.weight"].float()
        hidden = embed.shape[1]
        unit = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + eps)
        head = torch.zeros_like(state[prefix + "shared_head.head.weight"], dtype=torch.float32)
        for a, b in table.items():
            head[b] += unit[a]
        eh = torch.zeros(hidden, 2 * hidden)
        eh[:, :hidden] = torch.eye(hidden)
        dtype = state[prefix + "eh_proj.weight"].dtype
        state[prefix + "eh_proj.weight"] = eh.to(dtype)
        state[prefix + "enorm.weight"] = torch.full((hidden,), SCALE, dtype=dtype)
        state[prefix + "hnorm.weight"] = torch.ones(hidden, dtype=dtype)
        state[prefix + "shared_head.norm.weight"] = torch.ones(hidden, dtype=dtype)
        state[prefix + "shared_head.head.weight"] = head.to(dtype)
        save_file(state, str(shard), metadata={"format": "pt"})
        return
    raise ValueError(f"{checkpoint}: no MTP layer ({prefix}eh_proj.weight) in its safetensors")
