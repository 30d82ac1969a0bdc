# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The gated delta rule of Qwen3-Next's linear-attention layers: chunked (prefill) and fused recurrent (decode and
speculative verification), with the recurrent state read from and written to the SSM state pool by slot.

Maths (per value head ``h``; ``S`` is ``[K, V]``; q and k L2-normalised with eps 1e-6 and q scaled by ``K ** -0.5``
when ``use_qk_l2norm``)::

    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - S_{t-1}^T k_t exp(g_t)))^T      o_t = S_t^T q_t

``g`` is the log decay (<= 0), ``beta`` in (0, 1). Grouped heads: ``H`` query/key heads serve ``HV`` value heads
(``HV % H == 0``; head ``h`` reads key head ``h // (HV // H)``). The SSM state pool is ``[slots, HV, K, V]``
(vLLM 0.11's ``gated_delta_net_state_shape``).

NPU path (what vllm-ascend v0.11.0 runs on hardware): the chunked prefill is a torch computation per sequence
(``vllm_ascend/ops/fla.py`` ``torch_chunk_gated_delta_rule`` in place of FLA's chunk kernel, called per sequence from
``vllm_ascend/models/qwen3_next.py``), so the NPU entry is our twin; the fused recurrent rule is vLLM's FLA
``fused_recurrent_gated_delta_rule`` (a Triton kernel; vllm-ascend swaps in its own kernel body) compiled by
Triton-Ascend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm_npu.interface import Kernel

from ._triton_ascend import require_triton_ascend

#: Chunk length of the chunked form (FLA's and vllm-ascend's choice).
CHUNK = 64


def _prepare(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q (scaled) and k, L2-normalised when asked, query/key heads repeated to the value heads."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    groups = num_v_heads // q.shape[-2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q, k


def _chunk_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in fp32: q, k ``[L, HV, K]`` (prepared), v ``[L, HV, V]``, g, beta ``[L, HV]``, state
    ``[HV, K, V]``; returns (o ``[L, HV, V]``, final state)."""
    length = q.shape[0]
    pad = (-length) % CHUNK
    # zero g and beta on the padding: no decay, no write, so the final state is that of the real tokens
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))  # [HV, L', *]
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))  # [HV, L']
    heads, n = q.shape[0], q.shape[1] // CHUNK
    q, k, v = (x.reshape(heads, n, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, n, CHUNK).cumsum(-1), beta.reshape(heads, n, CHUNK)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [HV, n, C, C]
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    # WY form: T = (I + strictly_lower(k_beta k^T decay))^-1
    strict = (k_beta @ k.transpose(-1, -2) * decay).masked_fill(~lower.tril(-1), 0)
    t_inv = torch.linalg.solve_triangular(eye + strict, eye.expand_as(strict), upper=False, unitriangular=True)
    u = t_inv @ v_beta
    w = t_inv @ (k_beta * g.exp()[..., None])
    out = torch.empty_like(v)
    for i in range(n):
        attn = q[:, i] @ k[:, i].transpose(-1, -2) * decay[:, i]
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = (q[:, i] * g[:, i, :, None].exp()) @ state + attn @ v_new
        last = g[:, i, -1]
        state = (
            state * last.exp()[:, None, None]
            + (k[:, i] * (last[:, None] - g[:, i]).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    return out.reshape(heads, n * CHUNK, -1)[:, :length].transpose(0, 1), state


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over ``N`` packed sequences (prefill; reference twin and NPU path).

    q, k ``[T, H, K]``; v ``[T, HV, V]``; g, beta ``[T, HV]``; ``ssm_states`` ``[slots, HV, K, V]``: sequence ``i``
    starts from slot ``state_indices[i]`` when ``has_initial_state[i]`` (zeros otherwise) and its final state is
    written back there (in the pool's dtype); ``query_start_loc`` ``[N + 1]``. Returns o ``[T, HV, V]`` in v's dtype
    (fp32 inside)."""
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    qp, kp = _prepare(q, k, v.shape[1], use_qk_l2norm, scale)
    starts = query_start_loc.tolist()
    slots = state_indices.tolist()
    initial = [False] * (len(starts) - 1) if has_initial_state is None else has_initial_state.tolist()
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        slot = slots[i]
        state = (
            ssm_states[slot].float() if initial[i] else ssm_states.new_zeros(ssm_states.shape[1:], dtype=torch.float32)
        )
        o, final = _chunk_one(qp[lo:hi], kp[lo:hi], v[lo:hi].float(), g[lo:hi].float(), beta[lo:hi].float(), state)
        out[lo:hi] = o.to(v.dtype)
        ssm_states[slot] = final.to(ssm_states.dtype)
    return out


def fused_recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Fused recurrent gated delta rule (decode and speculative verification; reference twin).

    q, k ``[T, H, K]``, v ``[T, HV, V]``, g, beta ``[T, HV]``, packed; ``ssm_states`` ``[slots, HV, K, V]`` updated in
    place; ``-1`` slots (padding) are clamped to the null slot 0. No host synchronisation, so it can be captured in a
    graph. Returns o ``[T, HV, V]`` in v's dtype.

    - Decode: ``state_indices`` ``[N]``, one token per sequence (``T = N``): read and write that slot.
    - Verification: ``state_indices`` ``[>= N, Q]`` (``Q = 1 + k`` slots per request), ``query_start_loc``
      ``[N + 1]`` (sequence ``i`` is tokens ``loc[i]:loc[i + 1]``, at most ``Q`` of them; tokens past ``loc[N]``
      get 0): start from slot ``[i, num_accepted_tokens[i] - 1]`` (``[i, 0]`` when None), write the state after
      its token ``t`` to slot ``[i, t]`` (vLLM's FLA kernel with ``num_accepted_tokens`` and
      ``inplace_final_state``)."""
    if state_indices.dim() == 2:
        return _recurrent_spec(
            q, k, v, g, beta, ssm_states, query_start_loc, state_indices, num_accepted_tokens, use_qk_l2norm, scale
        )
    del query_start_loc
    n = state_indices.shape[0]
    per_seq = q.shape[0] // max(n, 1)  # 1 when decoding
    qp, kp = _prepare(q, k, v.shape[1], use_qk_l2norm, scale)
    shape = (n, per_seq)
    qp, kp, vf = (x.reshape(*shape, *x.shape[1:]) for x in (qp, kp, v.float()))
    gf, bf = (x.float().reshape(*shape, x.shape[-1]) for x in (g, beta))
    slots = state_indices.long().clamp(min=0)
    state = ssm_states[slots].float()  # [N, HV, K, V]
    out = torch.empty_like(vf)
    for t in range(per_seq):
        state = state * gf[:, t].exp()[..., None, None]
        kt = kp[:, t]
        delta = (vf[:, t] - torch.einsum("nhk,nhkv->nhv", kt, state)) * bf[:, t, :, None]
        state = state + kt[..., None] * delta[..., None, :]
        out[:, t] = torch.einsum("nhk,nhkv->nhv", qp[:, t], state)
    ssm_states[slots] = state.to(ssm_states.dtype)
    return out.reshape(v.shape).to(v.dtype)


def _recurrent_spec(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None,
    use_qk_l2norm: bool,
    scale: float | None,
) -> torch.Tensor:
    """The verification branch of :func:`fused_recurrent_gated_delta_rule_ref`: all sequences step together over
    ``Q`` token columns; a column past a sequence's length leaves its state alone and writes only to slot 0."""
    n, q_max = query_start_loc.shape[0] - 1, state_indices.shape[1]
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    if n == 0 or v.shape[0] == 0:
        return out.to(v.dtype)
    qp, kp = _prepare(q, k, v.shape[1], use_qk_l2norm, scale)
    vf, gf, bf = v.float(), g.float(), beta.float()
    slots = state_indices[:n].long().clamp(min=0)  # [N, Q]
    first = slots[:, 0] if num_accepted_tokens is None else slots.gather(
        1, (num_accepted_tokens[:n].long() - 1).clamp(min=0)[:, None]
    )[:, 0]  # fmt: skip
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    state = ssm_states[first].float()  # [N, HV, K, V]
    for t in range(q_max):
        valid = t < lens  # [N]
        rows = (starts + t).clamp(max=v.shape[0] - 1)
        stepped = state * gf[rows].exp()[..., None, None]
        kt = kp[rows]
        delta = (vf[rows] - torch.einsum("nhk,nhkv->nhv", kt, stepped)) * bf[rows][..., None]
        stepped = stepped + kt[..., None] * delta[..., None, :]
        state = torch.where(valid[:, None, None, None], stepped, state)
        o = torch.einsum("nhk,nhkv->nhv", qp[rows], state) * valid[:, None, None]
        out.index_put_((rows,), o, accumulate=True)  # every real token is some (i, t) exactly once
        target = torch.where(valid, slots[:, t], torch.zeros_like(slots[:, t]))
        ssm_states[target] = state.to(ssm_states.dtype)
    return out.to(v.dtype)


def fused_recurrent_gated_delta_rule_npu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """NPU path of :func:`fused_recurrent_gated_delta_rule_ref` (same contract): vLLM's FLA
    ``fused_recurrent_gated_delta_rule`` (batch 1, varlen by ``cu_seqlens``, ``inplace_final_state=True``) through
    Triton-Ascend, called as vllm-ascend v0.11.0's ``CustomQwen3NextGatedDeltaNet._forward`` calls it."""
    require_triton_ascend("fused_recurrent_gated_delta_rule")
    from vllm.model_executor.layers.fla.ops import fused_recurrent_gated_delta_rule

    n = state_indices.shape[0]
    o, _ = fused_recurrent_gated_delta_rule(
        q=q.unsqueeze(0),
        k=k.unsqueeze(0),
        v=v.unsqueeze(0),
        g=g.unsqueeze(0),
        beta=beta.unsqueeze(0),
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=ssm_states,
        inplace_final_state=True,
        cu_seqlens=query_start_loc[: n + 1],  # type: ignore[arg-type]  # vLLM annotates LongTensor; int32 is what it passes
        ssm_state_indices=state_indices,
        num_accepted_tokens=num_accepted_tokens,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    result: torch.Tensor = o[0]
    return result


#: Prefill: vllm-ascend runs a torch computation on hardware, so the NPU entry is the twin itself.
CHUNK_GATED_DELTA_RULE = Kernel("gdn_chunk_gated_delta_rule", chunk_gated_delta_rule_ref, chunk_gated_delta_rule_ref)
FUSED_RECURRENT_GATED_DELTA_RULE = Kernel(
    "gdn_fused_recurrent_gated_delta_rule", fused_recurrent_gated_delta_rule_npu, fused_recurrent_gated_delta_rule_ref
)
