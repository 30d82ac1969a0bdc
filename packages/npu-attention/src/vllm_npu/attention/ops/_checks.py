# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Contract checks shared by the GQA attention kernel twins (:mod:`.flash_attention`, :mod:`.paged_attention`).

Each raises :class:`~vllm_npu.interface.errors.KernelContractError` naming the kernel (``op``) and what is wrong.
"""

from __future__ import annotations

import torch
from vllm_npu.interface import KernelContractError


def no_soft_cap(logits_soft_cap: float | None, op: str) -> None:
    """The NPU twins' guard: no torch_npu attention kernel applies logits soft-capping."""
    if logits_soft_cap:
        raise KernelContractError(f"{op}: torch_npu has no attention kernel with logits soft-capping")


def need_mask(attn_mask: torch.Tensor | None, op: str) -> torch.Tensor:
    """The NPU twins' guard: their kernels take the metadata builder's mask, which it builds when they are selected."""
    if attn_mask is None:
        raise KernelContractError(f"{op}: the NPU kernel needs attn_mask; build the metadata with the NPU masks")
    return attn_mask


def check_packing(total: int, offsets: list[int], op: str) -> None:
    """``offsets`` (B + 1 cumulative entries) must start at 0, never decrease and end at ``total`` tokens."""
    if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise KernelContractError(f"{op}: sequence offsets {offsets[:4]}... do not pack the {total} tokens")


def check_heads(query: torch.Tensor, keys: torch.Tensor, num_heads: int, num_kv_heads: int, op: str) -> None:
    """``query [..., N, D]`` and ``keys [..., Nkv, D]`` (tokens or a paged cache) must carry the declared head
    counts, and ``N`` must be a multiple of ``Nkv`` (GQA)."""
    if query.shape[-2] != num_heads or keys.shape[-2] != num_kv_heads:
        raise KernelContractError(
            f"{op}: query has {query.shape[-2]} heads and the keys {keys.shape[-2]}, "
            f"expected num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    if num_heads % num_kv_heads:
        raise KernelContractError(f"{op}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
