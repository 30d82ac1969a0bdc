# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Token permutation for MoE: group the (token, slot) pairs by expert, and put them back.

Notation: T tokens, k slots per token (top-k), H hidden size, E expert ids, ``flat = t * k + j`` the index of slot j
of token t in ``topk_ids.reshape(-1)``.

:func:`init_routing_npu` / :func:`init_routing_reference` (``npu_moe_init_routing_v2`` semantics, dropless, no
quantisation)::

    (hidden [T, H], topk_ids [T, k] int, num_experts E, expert_range [start, end))
        -> expanded_x [T*k, H]        rows sorted stably by expert id; only experts in the range, first
           expanded_row_idx [T*k] int32   expanded row i came from slot expanded_row_idx[i] (a flat index);
                                          -1 for the rows past the in-range ones
           counts [end - start] int64     rows per local expert (``group_list_type=1`` counts)

Rows past ``counts.sum()`` are undefined on the NPU (zeros in the reference): callers slice them off.

:func:`unpermute_npu` / :func:`unpermute_reference` (``npu_moe_token_unpermute``): ``sorted_indices`` is a full
permutation of ``range(T*k)`` (row i holds slot ``sorted_indices[i]``) and ``out[t] = sum_j probs[t, j] *
permuted[pos(t, j)]``. :func:`finalize_routing_npu` / :func:`finalize_routing_reference`
(``npu_moe_finalize_routing``) have the same contract: the eager path uses the unpermute (as vllm-ascend v0.11.0's
eager MoE does), a graph compiled for torchair the finalize (as vllm-ascend's torchair MoE does; the unpermute has no
GE converter). :func:`combine_masked` is the same sum in plain torch for a partial set of rows (expert
parallel with replicated tokens) and for the dtypes the NPU op does not take (it is documented for bf16 only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm_npu.interface import Kernel, KernelBackend, is_310p

RoutingOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
InitRouting = Callable[[torch.Tensor, torch.Tensor, int, tuple[int, int]], RoutingOutput]
Unpermute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def init_routing_npu(
    hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, expert_range: tuple[int, int]
) -> RoutingOutput:
    """Permute with ``npu_moe_init_routing_v2`` (count mode, gather-type row index, no quantisation)."""
    import torch_npu

    num_tokens, top_k = topk_ids.shape
    expanded_x, expanded_row_idx, counts, _scale = torch_npu.npu_moe_init_routing_v2(
        hidden,
        topk_ids.to(torch.int32),
        active_num=num_tokens * top_k,
        expert_capacity=-1,
        expert_num=num_experts,
        drop_pad_mode=0,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        quant_mode=-1,
        active_expert_range=[expert_range[0], expert_range[1]],
        row_idx_type=0,
    )
    return expanded_x, expanded_row_idx, counts


def init_routing_reference(
    hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, expert_range: tuple[int, int]
) -> RoutingOutput:
    """Reference twin of :func:`init_routing_npu` (vectorised: one stable sort, no per-token loop)."""
    start, end = expert_range
    if not 0 <= start <= end <= num_experts:
        raise ValueError(f"expert_range={expert_range} must satisfy 0 <= start <= end <= num_experts={num_experts}")
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    in_range = (flat >= start) & (flat < end)
    # Out-of-range slots get a key past every local expert, so one stable sort puts them last in slot order.
    key = torch.where(in_range, flat - start, torch.full_like(flat, end - start))
    order = torch.sort(key, stable=True).indices
    # Tensors only, no count read on the host: the torchair decode graph traces this twin (static shapes).
    valid = in_range.index_select(0, order)  # the in-range rows come first
    expanded_row_idx = torch.where(valid, order, torch.full_like(order, -1)).to(torch.int32)
    rows = hidden.index_select(0, order // top_k)
    expanded_x = torch.where(valid.unsqueeze(1), rows, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
    counts = torch.zeros(end - start + 1, dtype=torch.int64, device=hidden.device)
    counts = counts.index_add(0, key, torch.ones_like(key))[: end - start]
    return expanded_x, expanded_row_idx, counts


INIT_ROUTING = Kernel("moe_init_routing", npu=init_routing_npu, reference=init_routing_reference)


def init_routing_310p_npu(
    hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, expert_range: tuple[int, int]
) -> RoutingOutput:
    """:func:`init_routing_npu`'s contract on an Ascend 310P, where ``npu_moe_init_routing_v2`` is not documented
    (torch_npu 2.8.0 lists it for A2/A3 only): the permutation in torch ops, as vllm-ascend v0.11.0's MoGE token
    dispatcher computes it for Pangu Pro MoE on the 300I Duo (``ops/moe/token_dispatcher.py:427-447``): an argsort of
    the expert ids cast to float32 (exact below 2**24), ``index_select`` of the token rows, and the per-expert counts
    as a float32 sum of a one-hot comparison. The sort is stable (this contract's row order; vllm-ascend's combine
    inverts any permutation, ours reads ``expanded_row_idx``)."""
    start, end = expert_range
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    in_range = (flat >= start) & (flat < end)
    key = torch.where(in_range, flat - start, torch.full_like(flat, end - start))
    order = torch.sort(key.float(), stable=True).indices
    valid = in_range.index_select(0, order)
    expanded_row_idx = torch.where(valid, order, torch.full_like(order, -1)).to(torch.int32)
    rows = hidden.index_select(0, order // top_k)
    expanded_x = torch.where(valid.unsqueeze(1), rows, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
    local = torch.arange(end - start, device=flat.device)
    counts = (key.unsqueeze(-1) == local).to(torch.float32).sum(0).to(torch.int64)
    return expanded_x, expanded_row_idx, counts


def init_routing_310p_reference(
    hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, expert_range: tuple[int, int]
) -> RoutingOutput:
    """Reference twin of :func:`init_routing_310p_npu`: the contract is :func:`init_routing_npu`'s, so is the twin
    (:func:`init_routing_reference`); named apart so that a layer shows which pair its chip picked."""
    return init_routing_reference(hidden, topk_ids, num_experts, expert_range)


#: The 310P's pair (:func:`init_routing_kernel` picks it on that chip).
INIT_ROUTING_310P = Kernel("moe_init_routing_310p", npu=init_routing_310p_npu, reference=init_routing_310p_reference)


def init_routing_kernel() -> Kernel:
    """The token permutation's kernel pair on this process's chip (310P: torch ops, no ``npu_moe_init_routing_v2``)."""
    return INIT_ROUTING_310P if is_310p() else INIT_ROUTING


def unpermute_npu(permuted: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Weighted un-permutation with ``npu_moe_token_unpermute`` (bf16 only, per the docs)."""
    import torch_npu

    return torch_npu.npu_moe_token_unpermute(
        permuted, sorted_indices.to(torch.int64), probs=probs.to(permuted.dtype), padded_mode=False
    )


def unpermute_reference(permuted: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Reference twin of :func:`unpermute_npu`: permuted [T*k, H], sorted_indices [T*k], probs [T, k] -> [T, H].

    Accumulates in float32 and returns ``permuted.dtype``.
    """
    num_tokens, top_k = probs.shape
    position = torch.empty_like(sorted_indices, dtype=torch.int64)
    position[sorted_indices.long()] = torch.arange(sorted_indices.numel(), device=sorted_indices.device)
    rows = permuted.index_select(0, position).view(num_tokens, top_k, permuted.shape[-1]).float()
    return torch.bmm(probs.float().unsqueeze(1), rows).squeeze(1).to(permuted.dtype)


UNPERMUTE = Kernel("moe_token_unpermute", npu=unpermute_npu, reference=unpermute_reference)


def src_to_dst_rows(sorted_indices: torch.Tensor, top_k: int) -> torch.Tensor:
    """``npu_moe_finalize_routing``'s ``expanded_src_to_dst_row`` [T*k] int32 for a gather-type full permutation.

    ``sorted_indices[i]`` is the flat slot ``t * k + j`` held by permuted row i; the op wants, at ``j * T + t``
    (slot-major, the layout ``npu_moe_init_routing`` writes for vllm-ascend's ``row_idx``), the row holding slot j
    of token t. A scatter inverts the permutation (``aten.scatter``: GE converts it, unlike an index assignment).
    """
    flat = sorted_indices.long()
    rows = torch.arange(flat.numel(), device=flat.device)
    position = torch.empty_like(flat).scatter(0, flat, rows)
    return position.view(-1, top_k).t().reshape(-1).to(torch.int32)


def finalize_routing_npu(permuted: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """:func:`unpermute_npu`'s contract with ``npu_moe_finalize_routing`` (float16, bfloat16, float32), the
    combine vllm-ascend v0.11.0's torchair MoE runs: it has a GE converter, ``npu_moe_token_unpermute`` has none."""
    import torch_npu

    return torch_npu.npu_moe_finalize_routing(
        permuted,
        None,
        None,
        None,
        probs.to(permuted.dtype),
        src_to_dst_rows(sorted_indices, probs.shape[1]),
        None,
        drop_pad_mode=0,
    )


def finalize_routing_reference(
    permuted: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor
) -> torch.Tensor:
    """Reference twin of :func:`finalize_routing_npu`, the op's documented formula without skips or bias:
    ``out[t] = sum_j probs[t, j] * permuted[src_to_dst[j * T + t]]`` (float32 accumulation, ``permuted.dtype``)."""
    num_tokens, top_k = probs.shape
    dst = src_to_dst_rows(sorted_indices, top_k).long()
    rows = permuted.index_select(0, dst).view(top_k, num_tokens, permuted.shape[-1]).float()
    return (rows * probs.float().t().unsqueeze(-1)).sum(0).to(permuted.dtype)


FINALIZE_ROUTING = Kernel("moe_finalize_routing", npu=finalize_routing_npu, reference=finalize_routing_reference)


def combine_masked(
    rows: torch.Tensor, row_idx: torch.Tensor, probs: torch.Tensor, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``out[t] = sum over rows i with row_idx[i] // k == t of probs.flat[row_idx[i]] * rows[i]``.

    ``rows`` [N, H] and ``row_idx`` [N] (flat slot indices; -1 marks a row that contributes nothing, whatever its
    content, NaN included); probs [T, k]. Plain torch (index_add in float32), used on both backends.
    """
    num_tokens, top_k = probs.shape
    valid = row_idx >= 0
    slot = row_idx.long().clamp(min=0)
    weight = torch.where(valid, probs.reshape(-1).float().index_select(0, slot), torch.zeros((), device=rows.device))
    contrib = torch.where(valid.unsqueeze(1), rows.float(), torch.zeros((), device=rows.device)) * weight.unsqueeze(1)
    out = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    out.index_add_(0, slot // top_k, contrib)
    return out.to(out_dtype or rows.dtype)


def build_unpermute(act_dtype: torch.dtype, backend: KernelBackend | None = None) -> Unpermute:
    """The full-permutation combine for a layer: the NPU op for bf16, :func:`combine_masked` for other dtypes and on
    a 310P (``npu_moe_token_unpermute`` is documented for A2/A3 only; vllm-ascend v0.11.0's MoGE dispatcher combines
    in torch there, ``token_dispatcher.py:456-465``)."""
    if UNPERMUTE.select(backend) is not unpermute_npu:
        return unpermute_reference
    return unpermute_npu if act_dtype == torch.bfloat16 and not is_310p() else combine_masked


def build_graph_unpermute(backend: KernelBackend | None = None) -> Unpermute:
    """The full-permutation combine inside a compiled (torchair) graph: ``npu_moe_finalize_routing`` (or its twin),
    whose GE converter exists, for every float dtype."""
    return FINALIZE_ROUTING.select(backend)
