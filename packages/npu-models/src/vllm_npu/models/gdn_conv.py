# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The gated delta-net's short causal depthwise conv1d: varlen prefill with initial state, and the single-token update.

State layout (vLLM 0.11's ``MambaStateShapeCalculator.gated_delta_net_state_shape``): the conv state pool is
``[slots, W - 1, D]`` in the KV cache; the kernels take vLLM's transposed view ``[slots, D, W - 1]`` (as
``Qwen3NextGatedDeltaNet._forward`` passes it). A slot holds the last ``W - 1`` *inputs* of its sequence (pre-conv,
pre-activation). Slot ``i`` of a request is its mamba block id (``block_table[:, 0]``); slot 0 is vLLM's null block,
never owned by a request, so padded entries (``PAD_SLOT_ID = -1``) are clamped to it and write only garbage there.

NPU path (what vllm-ascend v0.11.0 runs on hardware, ``vllm_ascend/ops/casual_conv1d.py``): prefill is a torch
computation per sequence (our reference twin is that computation, so the NPU entry is the twin itself); the update is
a Triton kernel, for which we call vLLM's ``causal_conv1d_update`` compiled by Triton-Ascend
(:func:`._triton_ascend.require_triton_ascend`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm_npu.interface import Kernel

from ._triton_ascend import require_triton_ascend


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"causal conv1d: activation {activation!r} is not supported (use 'silu' or None)")


def causal_conv1d_prefill_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal conv1d over ``N`` packed sequences (reference twin).

    ``x`` ``[T, D]``; ``weight`` ``[D, W]``; ``bias`` ``[D]`` or None; ``conv_states`` ``[slots, D, W - 1]`` (read
    where ``has_initial_state[i]``, zeros otherwise; then written in place with the last ``W - 1`` inputs of each
    sequence, initial state included when the sequence is shorter); ``query_start_loc`` ``[N + 1]`` int;
    ``state_indices`` ``[>= N]`` int; ``has_initial_state`` ``[N]`` bool or None (= all False). Returns ``[T, D]`` in
    ``x``'s dtype, computed in fp32."""
    width = weight.shape[1]
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    slots = state_indices.tolist()
    initial = [False] * (len(starts) - 1) if has_initial_state is None else has_initial_state.tolist()
    w = weight.float().unsqueeze(1)
    b = None if bias is None else bias.float()
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        slot = slots[i]
        if initial[i]:
            prefix = conv_states[slot].float()
        else:
            prefix = x.new_zeros((x.shape[1], width - 1), dtype=torch.float32)
        seq = torch.cat([prefix, x[lo:hi].float().t()], dim=1)  # [D, W - 1 + L]
        y = F.conv1d(seq.unsqueeze(0), w, b, groups=x.shape[1])[0]  # [D, L]
        out[lo:hi] = _activate(y, activation).t().to(x.dtype)
        conv_states[slot] = seq[:, -(width - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One new token per sequence (reference twin): ``x`` ``[B, D]``; ``conv_states`` ``[slots, D, W - 1]`` updated
    in place at ``state_indices`` ``[B]`` (``-1`` = padding, clamped to the null slot 0); returns ``[B, D]``.
    No host synchronisation, so it can be captured in a graph."""
    slots = state_indices[: x.shape[0]].long().clamp(min=0)
    window = torch.cat([conv_states[slots].float(), x.float().unsqueeze(-1)], dim=-1)  # [B, D, W]
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    conv_states[slots] = window[..., 1:].to(conv_states.dtype)
    return _activate(y, activation).to(x.dtype)


def causal_conv1d_update_npu(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """NPU path of :func:`causal_conv1d_update_ref` (same contract): vLLM's Triton ``causal_conv1d_update`` through
    Triton-Ascend, the way vllm-ascend v0.11.0 calls it from ``CustomQwen3NextGatedDeltaNet._forward``."""
    require_triton_ascend("causal_conv1d_update")
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

    out: torch.Tensor = causal_conv1d_update(
        x, conv_states, weight, bias, activation, conv_state_indices=state_indices[: x.shape[0]]
    )
    return out


#: Prefill: vllm-ascend runs a torch computation on hardware, so the NPU entry is the twin itself.
CAUSAL_CONV1D_PREFILL = Kernel("gdn_causal_conv1d_prefill", causal_conv1d_prefill_ref, causal_conv1d_prefill_ref)
CAUSAL_CONV1D_UPDATE = Kernel("gdn_causal_conv1d_update", causal_conv1d_update_npu, causal_conv1d_update_ref)
