# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The gated delta-net's short causal depthwise conv1d: varlen prefill with initial state, and the single-token update.

State layout (vLLM 0.11's ``MambaStateShapeCalculator.gated_delta_net_state_shape``): the conv state pool is
``[slots, S, D]`` in the KV cache with ``S = W - 1 + k`` (``k`` speculative tokens, 0 without a speculative config);
the kernels take vLLM's transposed view ``[slots, D, S]`` (as ``Qwen3NextGatedDeltaNet._forward`` passes it). A slot
holds the last ``W - 1`` *inputs* of its sequence (pre-conv, pre-activation) at columns ``[0, W - 1)`` after a prefill
or a plain decode; after a speculative verification of ``L`` tokens it holds ``W - 2`` history inputs then the ``L``
new inputs, so that the next step, told ``a`` tokens were accepted, finds the sequence's last ``W - 1`` inputs at
columns ``[a - 1, a - 1 + W - 1)`` (vLLM's Triton ``causal_conv1d_update`` with ``num_accepted_tokens``). Slot ``i`` of a request is its mamba block id (``block_table[:, 0]``); slot 0 is vLLM's null block,
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

    ``x`` ``[T, D]``; ``weight`` ``[D, W]``; ``bias`` ``[D]`` or None; ``conv_states`` ``[slots, D, S >= W - 1]``
    (columns ``[0, W - 1)`` read where ``has_initial_state[i]``, zeros otherwise; then written in place with the last
    ``W - 1`` inputs of each sequence, initial state included when the sequence is shorter; as vLLM's Triton
    ``causal_conv1d_fn``, whose state length is ``W - 1`` whatever ``S``); ``query_start_loc`` ``[N + 1]`` int;
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
            prefix = conv_states[slot, :, : width - 1].float()
        else:
            prefix = x.new_zeros((x.shape[1], width - 1), dtype=torch.float32)
        seq = torch.cat([prefix, x[lo:hi].float().t()], dim=1)  # [D, W - 1 + L]
        y = F.conv1d(seq.unsqueeze(0), w, b, groups=x.shape[1])[0]  # [D, L]
        out[lo:hi] = _activate(y, activation).t().to(x.dtype)
        conv_states[slot, :, : width - 1] = seq[:, -(width - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
) -> torch.Tensor:
    """Conv update of decoding sequences (reference twin); ``conv_states`` ``[slots, D, S]`` updated in place at
    ``state_indices`` (``-1`` = padding, clamped to the null slot 0). No host synchronisation, so it can be captured
    in a graph. Returns ``x``'s shape and dtype.

    - Decode (``query_start_loc`` None): one token per sequence, ``x`` ``[B, D]``, ``state_indices`` ``[>= B]``; the
      window is columns ``[0, W - 1)`` plus the token, and those ``W - 1`` columns shift left by one with the token
      last (vLLM's Triton kernel without ``num_accepted_tokens``, whose state length is then ``W - 1``).
    - Speculative verification (``query_start_loc`` ``[N + 1]``, ``num_accepted_tokens`` ``[>= N]``,
      ``max_query_len`` = ``Q``, the verified tokens per request at most, ``1 + k``): sequence ``i`` is
      ``x[loc[i]:loc[i + 1]]`` (``L <= Q`` tokens, packed ``x`` ``[T, D]``; tokens past ``loc[N]`` get 0), its
      window starts at column ``a - 1`` (``a = num_accepted_tokens[i]``, the tokens of its previous step the
      sampler accepted); afterwards columns ``[0, W - 2)`` hold history columns ``[a, a + W - 2)`` and columns
      ``[W - 2, W - 2 + L)`` the ``L`` new inputs (vLLM's Triton kernel with ``num_accepted_tokens``; needs
      ``Q <= S - W + 2``). A sequence with ``L = 0`` keeps its state."""
    if query_start_loc is not None:
        assert num_accepted_tokens is not None, "speculative conv update needs num_accepted_tokens"
        return _conv_update_spec(
            x, conv_states, weight, bias, activation, state_indices, num_accepted_tokens, query_start_loc, max_query_len
        )
    width = weight.shape[1]
    slots = state_indices[: x.shape[0]].long().clamp(min=0)
    old = conv_states[slots].float()  # [B, D, S]
    xt = x.float().unsqueeze(-1)
    window = torch.cat([old[..., : width - 1], xt], dim=-1)  # [B, D, W]
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    conv_states[slots] = torch.cat([window[..., 1:], old[..., width - 1 :]], dim=-1).to(conv_states.dtype)
    return _activate(y, activation).to(x.dtype)


def _conv_update_spec(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
) -> torch.Tensor:
    """The verification branch of :func:`causal_conv1d_update_ref`: all sequences at once, ``Q`` token columns, the
    ones past a sequence's length masked (gathers and masks only, no host read)."""
    n = query_start_loc.shape[0] - 1
    width, dim, span = weight.shape[1], x.shape[1], conv_states.shape[-1]
    q_max = max_query_len if max_query_len > 0 else span - width + 2
    if q_max > span - width + 2:
        raise ValueError(
            f"causal conv1d update: {q_max} tokens per request need a conv state of >= {q_max + width - 2}"
        )
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if n == 0 or x.shape[0] == 0:
        return out.to(x.dtype)
    slots = state_indices[:n].long().clamp(min=0)
    if slots.dim() == 2:
        slots = slots[:, 0]
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts  # [N]
    steps = torch.arange(q_max, device=x.device)
    valid = steps[None, :] < lens[:, None]  # [N, Q]
    rows = (starts[:, None] + steps[None, :]).clamp(max=x.shape[0] - 1)  # [N, Q]
    new = x.float()[rows].transpose(1, 2) * valid[:, None, :]  # [N, D, Q]
    old = conv_states[slots].float()  # [N, D, S]
    first = (num_accepted_tokens[:n].long() - 1).clamp(min=0)
    cols = (first[:, None] + torch.arange(width - 1, device=x.device)[None, :]).clamp(max=span - 1)
    history = old.gather(2, cols[:, None, :].expand(n, dim, width - 1))  # [N, D, W - 1]
    seq = torch.cat([history, new], dim=-1)  # [N, D, W - 1 + Q]
    y = (seq.unfold(2, width, 1) * weight.float()[None, :, None, :]).sum(-1)  # [N, D, Q]
    if bias is not None:
        y = y + bias.float()[None, :, None]
    y = _activate(y, activation) * valid[:, None, :]
    out.index_put_((rows.reshape(-1),), y.transpose(1, 2).reshape(-1, dim), accumulate=True)  # each token once
    tail = torch.where(valid[:, None, :], new, old[..., width - 2 : width - 2 + q_max])
    updated = torch.cat([history[..., 1:], tail, old[..., width - 2 + q_max :]], dim=-1)
    updated = torch.where((lens > 0)[:, None, None], updated, old)
    conv_states[slots] = updated.to(conv_states.dtype)
    return out.to(x.dtype)


def causal_conv1d_update_npu(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
) -> torch.Tensor:
    """NPU path of :func:`causal_conv1d_update_ref` (same contract): vLLM's Triton ``causal_conv1d_update`` through
    Triton-Ascend. Decode: the way vllm-ascend v0.11.0 calls it from ``CustomQwen3NextGatedDeltaNet._forward``;
    verification: the way vLLM 0.11's ``Qwen3NextGatedDeltaNet._forward`` calls it (vllm-ascend v0.11.0 has no
    verification conv call: it serves no Qwen3-Next MTP)."""
    require_triton_ascend("causal_conv1d_update")
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

    out: torch.Tensor
    if query_start_loc is None:
        out = causal_conv1d_update(
            x, conv_states, weight, bias, activation, conv_state_indices=state_indices[: x.shape[0]]
        )
        return out
    n = query_start_loc.shape[0] - 1
    slots = state_indices[:n, 0] if state_indices.dim() == 2 else state_indices[:n]
    out = causal_conv1d_update(
        x,
        conv_states,
        weight,
        bias,
        activation,
        conv_state_indices=slots,
        num_accepted_tokens=num_accepted_tokens,
        query_start_loc=query_start_loc,
        max_query_len=max_query_len,
    )
    return out


#: Prefill: vllm-ascend runs a torch computation on hardware, so the NPU entry is the twin itself.
CAUSAL_CONV1D_PREFILL = Kernel("gdn_causal_conv1d_prefill", causal_conv1d_prefill_ref, causal_conv1d_prefill_ref)
CAUSAL_CONV1D_UPDATE = Kernel("gdn_causal_conv1d_update", causal_conv1d_update_npu, causal_conv1d_update_ref)
