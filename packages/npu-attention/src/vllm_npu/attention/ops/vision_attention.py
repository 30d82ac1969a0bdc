# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Vision-encoder attention: bidirectional attention within each unpadded sequence of a packed batch.

``vision_attention`` — what a ViT block (Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision towers) computes per image, frame
or window: every token attends to all tokens of its own sequence and to no other (a block-diagonal mask given by
``cu_seqlens``), no causality, no cache:
    query ``[T, N, D]``, key/value ``[T, Nkv, D]`` packed per sequence; seq_lens ``torch.Tensor`` int32 ``[B]`` on
    the CPU (per-sequence lengths, summing to T: ``cu_seqlens[1:] - cu_seqlens[:-1]``); scale the softmax scale;
    out ``[T, N, D]`` (query's dtype) written in place. Zero-length sequences are allowed.
    NPU: ``torch_npu._npu_flash_attention_unpad`` (ATB binding of torch_npu 2.8.0: ``query, key, value, seq_len,
    scale_value, num_heads, num_kv_heads, out``; fp16/bf16), as vllm-ascend v0.11.0's vision attention calls it.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from vllm_npu.interface import Kernel, KernelContractError

from .flash_attention import _attend_packed


def _check_seq_lens(seq_lens: torch.Tensor, total: int) -> list[int]:
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise KernelContractError(
            "vision_attention: seq_lens must be a 1-D int32 tensor of per-sequence lengths "
            "(cu_seqlens.diff().to(torch.int32).cpu()), got "
            f"{type(seq_lens).__name__} {getattr(seq_lens, 'dtype', '')} {tuple(getattr(seq_lens, 'shape', ()))}"
        )
    if seq_lens.device.type != "cpu":
        raise KernelContractError("vision_attention: seq_lens must be on the CPU (the kernel reads it on the host)")
    lens = seq_lens.tolist()
    if any(n < 0 for n in lens) or sum(lens) != total:
        raise KernelContractError(f"vision_attention: seq_lens {lens[:4]}... do not pack the {total} tokens")
    return lens


def vision_attention_npu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    _check_seq_lens(seq_lens, query.shape[0])
    import torch_npu

    torch_npu._npu_flash_attention_unpad(
        query=query,
        key=key,
        value=value,
        seq_len=seq_lens,
        scale_value=scale,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        out=out,
    )


def vision_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    lens = _check_seq_lens(seq_lens, query.shape[0])
    _attend_packed(
        "vision_attention",
        query,
        key,
        value,
        list(accumulate(lens, initial=0)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        scale=scale,
        out=out,
        causal=False,
        sliding_window=None,
        logits_soft_cap=None,
    )


VISION_ATTENTION = Kernel("vision_attention", npu=vision_attention_npu, reference=vision_attention_reference)
