# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU twin of the sliding-window decode (:data:`.paged_attention.PAGED_DECODE_WINDOW`, whose module docstring
states the contract) and the scratch a captured graph task of it needs.

``npu_fused_infer_attention_score.out`` in BSH with Q_S = 1 and an explicit ``[B, 1, KV_S]`` window mask
(``sparse_mode=0``). Inside a captured ACL graph the mask, the softmax LSE buffer and the kernel's maximum workspace
are made before the task (:func:`paged_decode_window_scratch_npu`), so that the task group holds the ``.out`` kernel
alone and a task update changes only the host ``actual_seq_lengths_kv``, as torch_npu's own graph dispatch does
(``npu/graphs.py:137-160``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._checks import no_soft_cap
from .fia import fia_max_workspace, fia_out, gqa_paged_bsh

if TYPE_CHECKING:
    from .paged_attention import DecodePlan


def window_mask(
    seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int, sliding_window: int
) -> torch.Tensor:
    """The window decode's ``[B, 1, KV_S]`` bool mask (True = hidden): cache position ``j`` of request ``b`` is hidden
    when ``j < seq_lens[b] - sliding_window``; ``KV_S = block_table.shape[1] * block_size`` (the block table's
    capacity, as the FIA docs require for a paged cache with ``sparse_mode=0``). Device ops only: inside a captured
    graph it is recomputed at every replay from the ``seq_lens`` buffer."""
    pos = torch.arange(block_table.shape[1] * block_size, device=seq_lens.device)
    first = seq_lens.to(torch.long) - sliding_window  # first visible position
    return (pos[None, :] < first[:, None]).unsqueeze(1)


def paged_decode_window_scratch_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    sliding_window: int,
) -> dict[str, torch.Tensor]:
    """What a captured :func:`paged_decode_window_npu` task needs allocated before its task group: the window
    ``mask`` (:func:`window_mask`), a ``softmax_lse`` buffer (one element, as torch_npu's graph dispatch allocates,
    ``npu/graphs.py:148``) and the kernel's maximum workspace over every sequence length
    (``_npu_fused_infer_attention_score_get_max_workspace``, the same arguments as the op), so that a task update
    only changes the host ``actual_seq_lengths_kv``."""
    mask = window_mask(seq_lens, block_table, key_cache.shape[1], sliding_window)
    args = gqa_paged_bsh(
        query, key_cache, value_cache, block_table, context_lens, mask,
        num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
    )  # fmt: skip
    return {"mask": mask, "lse": query.new_empty(1), "workspace": fia_max_workspace(args)}


def paged_decode_window_npu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    sliding_window: int,
    out: torch.Tensor,
    logits_soft_cap: float | None = None,
    plan: DecodePlan | None = None,
    mask: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> None:
    """``out [B, N, D]`` (contiguous) through ``npu_fused_infer_attention_score.out``. ``mask``, ``lse`` and
    ``workspace`` come from :func:`paged_decode_window_scratch_npu` inside a captured graph; eagerly they may be None
    (made here; the kernel then sizes its own workspace)."""
    no_soft_cap(logits_soft_cap, "paged_decode_window")
    # With one query token per request the kernel ignores pre_tokens, next_tokens and sparse_mode (torch_npu 2.8.0
    # docs: "Q_S为1时该参数无效"), so the window cannot be a band: it is an explicit per-request mask [B, 1, KV_S].
    # BSH with Q_S = 1 is the layout vllm-ascend v0.11.0 uses for its sliding-window decode.
    if mask is None:
        mask = window_mask(seq_lens, block_table, key_cache.shape[1], sliding_window)
    args = gqa_paged_bsh(
        query, key_cache, value_cache, block_table, context_lens, mask,
        num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale,
    )  # fmt: skip
    fia_out(args, out=out, lse=query.new_empty(1) if lse is None else lse, workspace=workspace)
