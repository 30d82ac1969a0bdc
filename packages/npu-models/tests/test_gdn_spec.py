# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The GDN kernel twins on speculative verification (Qwen3-Next's MTP): ``1 + k`` tokens per request, ragged (a
request may verify fewer), per-request accepted counts from the previous step, padded rows, against plain maths; and a
token stream served by verification steps with rejected drafts gives the outputs of plain token-by-token decoding."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from vllm_npu.models.gdn_conv import causal_conv1d_prefill_ref, causal_conv1d_update_npu, causal_conv1d_update_ref
from vllm_npu.models.gdn_delta import fused_recurrent_gated_delta_rule_npu, fused_recurrent_gated_delta_rule_ref

H, HV, K, V, D, W = 2, 4, 8, 6, 10, 4


def _plain_step(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    """One token of the gated delta rule in float64, heads matched (``[HV, ...]``), q/k L2-normalised, q scaled."""
    q = F.normalize(q.double(), dim=-1, eps=1e-12) * K**-0.5
    k = F.normalize(k.double(), dim=-1, eps=1e-12)
    state = state.double() * g.double().exp()[:, None, None]
    err = v.double() - torch.einsum("hk,hkv->hv", k, state)
    state = state + k[:, :, None] * (beta.double()[:, None] * err)[:, None, :]
    return torch.einsum("hk,hkv->hv", q, state), state


def _tokens(total: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (
        torch.randn(total, H, K, generator=gen),
        torch.randn(total, H, K, generator=gen),
        torch.randn(total, HV, V, generator=gen),
        -torch.rand(total, HV, generator=gen),
        torch.rand(total, HV, generator=gen),
    )


def _loc(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def test_recurrent_verification_is_ragged_and_leaves_unverified_slots_alone() -> None:
    """Three requests verifying 3, 1 and 2 of at most 3 tokens, accepted counts 2, 1, 3 from their previous step, a
    padded row (``-1`` slots) and two padded tokens past the last request (a graph's padding)."""
    gen = torch.Generator().manual_seed(11)
    lens, accepted = [3, 1, 2], torch.tensor([2, 1, 3, 1], dtype=torch.int32)
    q, k, v, g, beta = _tokens(sum(lens) + 2, gen)
    pool = torch.randn(12, HV, K, V, generator=gen)
    before = pool.clone()
    slots = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [-1, -1, -1]], dtype=torch.int32)
    out = fused_recurrent_gated_delta_rule_ref(q, k, v, g, beta, pool, _loc(lens), slots, accepted)
    rep = HV // H
    lo = 0
    for i, n in enumerate(lens):
        state = before[slots[i, accepted[i] - 1]]
        for t in range(n):
            row = lo + t
            want, state = _plain_step(q[row].repeat_interleave(rep, 0), k[row].repeat_interleave(rep, 0), v[row],
                                      g[row], beta[row], state)  # fmt: skip
            torch.testing.assert_close(out[row].double(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pool[slots[i, t]].double(), state, rtol=1e-5, atol=1e-5)
        for t in range(n, 3):  # slots of tokens this request did not verify keep their contents
            torch.testing.assert_close(pool[slots[i, t]], before[slots[i, t]], rtol=0, atol=0)
        lo += n
    assert out[sum(lens) :].abs().max() == 0  # padded tokens
    torch.testing.assert_close(pool[10:], before[10:], rtol=0, atol=0)  # slots nobody owns


def test_conv_verification_window_and_state_for_every_acceptance() -> None:
    """Plain maths: request ``i`` convolves its last ``W - 1`` inputs (read at column ``a - 1``) followed by its
    ``L`` new inputs; afterwards, whatever number ``a'`` of them the sampler accepts, columns ``[a' - 1, a' + W - 2)``
    hold the last ``W - 1`` inputs up to accepted token ``a'``. A request verifying 0 tokens keeps its state."""
    gen = torch.Generator().manual_seed(12)
    k_spec = 2
    lens, accepted = [3, 2, 0, 1], torch.tensor([1, 3, 2, 2, 1], dtype=torch.int32)
    x = torch.randn(sum(lens) + 1, D, generator=gen)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    pool = torch.randn(8, D, W - 1 + k_spec, generator=gen)
    before = pool.clone()
    slots = torch.tensor([[3, 0, 0], [5, 0, 0], [6, 0, 0], [2, 0, 0], [-1, 0, 0]], dtype=torch.int32)
    out = causal_conv1d_update_ref(x, pool, weight, bias, "silu", slots, accepted, _loc(lens), k_spec + 1)
    lo = 0
    for i, n in enumerate(lens):
        slot, a = int(slots[i, 0]), int(accepted[i])
        full = torch.cat([before[slot][:, a - 1 : a - 1 + W - 1], x[lo : lo + n].t()], dim=1)
        for t in range(n):
            want = F.silu((full[:, t : t + W] * weight).sum(-1) + bias)
            torch.testing.assert_close(out[lo + t], want, rtol=1e-5, atol=1e-5)
        for kept in range(1, n + 1):
            torch.testing.assert_close(pool[slot][:, kept - 1 : kept - 1 + W - 1], full[:, kept : kept + W - 1])
        if n == 0:
            torch.testing.assert_close(pool[slot], before[slot], rtol=0, atol=0)
        lo += n
    assert out[sum(lens) :].abs().max() == 0
    torch.testing.assert_close(pool[[1, 4, 7]], before[[1, 4, 7]], rtol=0, atol=0)


def test_a_stream_served_by_verification_steps_equals_plain_decoding() -> None:
    """What MTP relies on: prefill, then steps that verify ``1 + k`` tokens of which only ``a`` are the stream's (the
    rest are rejected drafts, random here); the outputs of the accepted tokens and the states the next step reads
    equal plain token-by-token processing of the stream, for conv and recurrent rule alike."""
    gen = torch.Generator().manual_seed(13)
    k_spec, prompt, steps = 3, 5, [2, 4, 1, 3, 1, 4]  # accepted tokens per step (1 = the draft was wrong at once)
    total = prompt + sum(steps)
    q, k, v, g, beta = _tokens(total, gen)
    x = torch.randn(total, D, generator=gen)
    weight = torch.randn(D, W, generator=gen)
    conv_pool = torch.zeros(3, D, W - 1 + k_spec)
    ssm_pool = torch.zeros(1 + 1 + k_spec, HV, K, V)
    slots = torch.arange(1, 2 + k_spec, dtype=torch.int32)[None, :]  # the request's 1 + k state slots
    # plain: the whole stream, token by token
    rep = HV // H
    conv_want = F.silu(F.conv1d(F.pad(x.t(), (W - 1, 0))[None], weight[:, None, :], groups=D)[0]).t()
    state, rule_want = torch.zeros(HV, K, V, dtype=torch.float64), []
    for t in range(total):
        o, state = _plain_step(q[t].repeat_interleave(rep, 0), k[t].repeat_interleave(rep, 0), v[t], g[t], beta[t],
                               state)  # fmt: skip
        rule_want.append(o)
    # served: a prefill into slot [0, 0], then verification steps
    loc = torch.tensor([0, prompt], dtype=torch.int32)
    conv_got = causal_conv1d_prefill_ref(x[:prompt], weight, None, conv_pool, loc, slots[:, 0], None, "silu")
    torch.testing.assert_close(conv_got, conv_want[:prompt], rtol=1e-5, atol=1e-5)
    from vllm_npu.models.gdn_delta import chunk_gated_delta_rule_ref

    chunk_gated_delta_rule_ref(q[:prompt], k[:prompt], v[:prompt], g[:prompt], beta[:prompt], ssm_pool, loc,
                               slots[:, 0], None, True)  # fmt: skip
    pos, accepted = prompt, torch.ones(1, dtype=torch.int32)
    for a in steps:
        wrong = 1 + k_spec - a  # the drafts the sampler rejects
        cols = [torch.cat([t[pos : pos + a], torch.randn(wrong, *t.shape[1:], generator=gen)]) for t in (q, k, v, x)]
        gates = [torch.cat([t[pos : pos + a], -torch.rand(wrong, HV, generator=gen)]) for t in (g, beta)]
        loc = torch.tensor([0, 1 + k_spec], dtype=torch.int32)
        conv_got = causal_conv1d_update_ref(cols[3], conv_pool, weight, None, "silu", slots, accepted, loc, 1 + k_spec)
        rule_got = fused_recurrent_gated_delta_rule_ref(cols[0], cols[1], cols[2], gates[0], gates[1].abs(),
                                                        ssm_pool, loc, slots, accepted)  # fmt: skip
        torch.testing.assert_close(conv_got[:a], conv_want[pos : pos + a], rtol=1e-5, atol=1e-5)
        for t in range(a):
            torch.testing.assert_close(rule_got[t].double(), rule_want[pos + t], rtol=1e-5, atol=1e-5)
        pos, accepted = pos + a, torch.tensor([a], dtype=torch.int32)


def test_npu_paths_pass_the_verification_arguments_as_vllm_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NPU paths hand vLLM's Triton entry points what ``Qwen3NextGatedDeltaNet._forward`` hands them on a
    verification step (stand-ins record the call; the conv call must bind to vLLM's real signature)."""
    import vllm.model_executor.layers.mamba.ops.causal_conv1d as conv_ops
    import vllm.triton_utils

    calls: dict[str, dict[str, object]] = {}
    real_conv = inspect.signature(conv_ops.causal_conv1d_update)

    def conv_standin(*args: object, **kwargs: object) -> torch.Tensor:
        real_conv.bind(*args, **kwargs)
        calls["conv"] = kwargs
        return args[0]  # type: ignore[return-value]

    def rule_standin(**kwargs: object) -> tuple[torch.Tensor, None]:
        calls["rule"] = kwargs
        return kwargs["v"], None  # type: ignore[return-value]

    fla = types.ModuleType("vllm.model_executor.layers.fla.ops")
    fla.fused_recurrent_gated_delta_rule = rule_standin  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fla.__name__, fla)
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    monkeypatch.setattr(conv_ops, "causal_conv1d_update", conv_standin)
    gen = torch.Generator().manual_seed(14)
    slots = torch.tensor([[3, 4], [5, 6], [-1, -1]], dtype=torch.int32)
    accepted, loc = torch.tensor([2, 1, 1], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32)
    x, weight = torch.randn(4, D, generator=gen), torch.randn(D, W, generator=gen)
    causal_conv1d_update_npu(x, torch.zeros(7, D, W), weight, None, "silu", slots, accepted, loc, 2)
    conv = calls["conv"]
    assert conv["conv_state_indices"].tolist() == [3, 5]  # type: ignore[attr-defined]
    assert conv["num_accepted_tokens"] is accepted and conv["query_start_loc"] is loc and conv["max_query_len"] == 2
    q, k, v, g, beta = _tokens(4, gen)
    fused_recurrent_gated_delta_rule_npu(q, k, v, g, beta, torch.zeros(7, HV, K, V), loc, slots, accepted)
    rule = calls["rule"]
    assert rule["ssm_state_indices"] is slots and rule["num_accepted_tokens"] is accepted
    assert rule["cu_seqlens"].tolist() == [0, 2, 3] and rule["inplace_final_state"] is True  # type: ignore[attr-defined]
