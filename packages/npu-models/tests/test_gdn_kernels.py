# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The gated delta-net kernel twins (vllm_npu.models.gdn_*) against plain maths and HF transformers' torch functions
(``modeling_qwen3_next``: the golden the model is checked against), over ragged batches with and without initial
state; the NPU paths' gate without Triton."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf
from vllm_npu.interface import MissingComponentError
from vllm_npu.models.gdn_conv import (
    causal_conv1d_prefill_ref,
    causal_conv1d_update_npu,
    causal_conv1d_update_ref,
)
from vllm_npu.models.gdn_delta import (
    chunk_gated_delta_rule_ref,
    fused_recurrent_gated_delta_rule_npu,
    fused_recurrent_gated_delta_rule_ref,
)
from vllm_npu.models.gdn_norm import gdn_gating_npu, gdn_gating_ref, rms_norm_gated_npu, rms_norm_gated_ref

H, HV, K, V, D, W = 2, 4, 8, 6, 12, 4
LENS = [5, 70, 1, 130]  # one token, within a chunk, across one and two chunk boundaries


def _loc(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


def _inputs(total: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randn(total, H, K, generator=gen)
    k = torch.randn(total, H, K, generator=gen)
    v = torch.randn(total, HV, V, generator=gen)
    g = -torch.rand(total, HV, generator=gen)  # log decay <= 0
    beta = torch.rand(total, HV, generator=gen)
    return q, k, v, g, beta


def _plain_delta(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    """Token by token, one sequence, heads already matched; q, k L2-normalised and q scaled here."""
    q = F.normalize(q.double(), dim=-1, eps=1e-12) * K**-0.5
    k = F.normalize(k.double(), dim=-1, eps=1e-12)
    state = state.double().clone()
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].double().exp()[:, None, None]
        err = v[t].double() - torch.einsum("hk,hkv->hv", k[t], state)
        state = state + k[t][:, :, None] * (beta[t].double()[:, None] * err)[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(out), state


@pytest.mark.parametrize("with_initial", [False, True])
def test_chunk_rule_matches_plain_maths_and_hf(with_initial: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = _inputs(sum(LENS), gen)
    slots = torch.tensor([3, 1, 6, 4])
    pool = torch.randn(8, HV, K, V, generator=gen)
    initial = torch.tensor([with_initial, False, with_initial, with_initial])
    before = pool.clone()
    out = chunk_gated_delta_rule_ref(q, k, v, g, beta, pool, _loc(LENS), slots, initial)
    loc = _loc(LENS).tolist()
    rep = HV // H
    for i, (lo, hi) in enumerate(zip(loc, loc[1:])):
        s0 = before[slots[i]] if initial[i] else torch.zeros(HV, K, V)
        qi, ki = q[lo:hi].repeat_interleave(rep, 1), k[lo:hi].repeat_interleave(rep, 1)
        want, final = _plain_delta(qi, ki, v[lo:hi], g[lo:hi], beta[lo:hi], s0)
        torch.testing.assert_close(out[lo:hi].double(), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slots[i]].double(), final, rtol=1e-4, atol=1e-4)
        hf_out, hf_final = hf.torch_chunk_gated_delta_rule(
            qi[None], ki[None], v[lo:hi][None], g[lo:hi][None], beta[lo:hi][None],
            initial_state=s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(out[lo:hi], hf_out[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slots[i]], hf_final[0], rtol=1e-4, atol=1e-4)
    untouched = [s for s in range(8) if s not in slots.tolist()]
    torch.testing.assert_close(pool[untouched], before[untouched], rtol=0, atol=0)


def test_recurrent_decode_matches_hf_and_pads_to_the_null_slot() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = _inputs(3, gen)
    pool = torch.randn(6, HV, K, V, generator=gen)
    before = pool.clone()
    slots = torch.tensor([2, 5, -1])  # the last entry is graph padding
    out = fused_recurrent_gated_delta_rule_ref(q, k, v, g, beta, pool, torch.arange(4), slots)
    rep = HV // H
    for i, slot in enumerate([2, 5]):
        hf_out, hf_final = hf.torch_recurrent_gated_delta_rule(
            q[i : i + 1, None].repeat_interleave(rep, 2), k[i : i + 1, None].repeat_interleave(rep, 2),
            v[i : i + 1, None], g[i : i + 1, None], beta[i : i + 1, None],
            initial_state=before[slot][None], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(out[i], hf_out[0, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot], hf_final[0], rtol=1e-5, atol=1e-5)
    # only the two owned slots and the null slot 0 changed
    torch.testing.assert_close(pool[[1, 3, 4]], before[[1, 3, 4]], rtol=0, atol=0)


def test_recurrent_verification_starts_from_the_accepted_slot_and_writes_every_step() -> None:
    gen = torch.Generator().manual_seed(2)
    n, steps = 2, 3
    q, k, v, g, beta = _inputs(n * steps, gen)
    pool = torch.randn(10, HV, K, V, generator=gen)
    before = pool.clone()
    slots = torch.tensor([[1, 2, 3], [4, 5, 6]])
    accepted = torch.tensor([2, 1])
    out = fused_recurrent_gated_delta_rule_ref(q, k, v, g, beta, pool, torch.arange(0, 7, 3), slots, accepted)
    rep = HV // H
    for i in range(n):
        lo = i * steps
        s0 = before[slots[i, accepted[i] - 1]]
        qi, ki = q[lo : lo + steps].repeat_interleave(rep, 1), k[lo : lo + steps].repeat_interleave(rep, 1)
        state = s0
        for t in range(steps):
            want, state = _plain_delta(qi[t : t + 1], ki[t : t + 1], v[lo + t : lo + t + 1], g[lo + t : lo + t + 1],
                                       beta[lo + t : lo + t + 1], state)  # fmt: skip
            torch.testing.assert_close(out[lo + t].double(), want[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pool[slots[i, t]].double(), state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_initial", [False, True])
def test_conv_prefill_then_updates_match_hf(with_initial: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    lens = [1, 2, 7]  # shorter than, equal to and longer than the W - 1 state
    x = torch.randn(sum(lens), D, generator=gen)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    pool = torch.randn(5, D, W - 1, generator=gen)
    before = pool.clone()
    slots = torch.tensor([4, 2, 1])
    initial = torch.full((3,), with_initial)
    out = causal_conv1d_prefill_ref(x, weight, bias, pool, _loc(lens), slots, initial, "silu")
    loc = _loc(lens).tolist()
    for i, (lo, hi) in enumerate(zip(loc, loc[1:])):
        prefix = before[slots[i]] if with_initial else torch.zeros(D, W - 1)
        seq = torch.cat([prefix, x[lo:hi].t()], 1)
        want = torch.stack([F.silu((seq[:, t : t + W] * weight).sum(-1) + bias) for t in range(hi - lo)])
        torch.testing.assert_close(out[lo:hi], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slots[i]], seq[:, -(W - 1) :], rtol=0, atol=0)
    # then one decode token per sequence: HF's update keeps W inputs; ours keeps the last W - 1 of them
    new = torch.randn(3, D, generator=gen)
    hf_state = torch.cat([torch.zeros(3, D, 1), pool[slots]], dim=-1)
    want = hf.torch_causal_conv1d_update(new[:, :, None], hf_state, weight, bias, "silu")[:, :, 0]
    got = causal_conv1d_update_ref(new, pool, weight, bias, "silu", slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[slots], hf_state[..., 1:], rtol=0, atol=0)


def test_gated_norm_and_gating_match_hf() -> None:
    gen = torch.Generator().manual_seed(4)
    norm = hf.Qwen3NextRMSNormGated(V, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(V, generator=gen))
    x, z = torch.randn(7, V, generator=gen), torch.randn(7, V, generator=gen)
    torch.testing.assert_close(rms_norm_gated_ref(x, z, norm.weight.detach(), 1e-6), norm(x, z).detach())
    a_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    a, b = torch.randn(7, HV, generator=gen) * 30, torch.randn(7, HV, generator=gen)  # some past the threshold
    g, beta = gdn_gating_ref(a_log, a, b, dt_bias)
    torch.testing.assert_close(g, -a_log.exp() * F.softplus(a + dt_bias))
    torch.testing.assert_close(beta, b.sigmoid())


@pytest.mark.parametrize(
    "call",
    [
        lambda: causal_conv1d_update_npu(torch.zeros(1, D), torch.zeros(2, D, W - 1), torch.zeros(D, W), None, "silu", torch.zeros(1, dtype=torch.long)),
        lambda: fused_recurrent_gated_delta_rule_npu(*_inputs(1, torch.Generator()), torch.zeros(2, HV, K, V), torch.arange(2), torch.zeros(1, dtype=torch.long)),
        lambda: rms_norm_gated_npu(torch.zeros(1, V), torch.zeros(1, V), torch.ones(V), 1e-6),
        lambda: gdn_gating_npu(torch.zeros(HV), torch.zeros(1, HV), torch.zeros(1, HV), torch.zeros(HV)),
    ],
)  # fmt: skip
def test_npu_paths_without_triton_name_the_install_line(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MissingComponentError, match=r"triton-ascend"):
        call()


# --- the NPU paths' wiring, against stand-ins of the Triton entry points they call (vLLM's contracts) -------------


def _standin_conv_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, **_):  # type: ignore[no-untyped-def]
    out = torch.empty_like(x)
    for i, slot in enumerate(conv_state_indices.tolist()):
        window = torch.cat([conv_state[slot], x[i][:, None]], dim=1)
        conv_state[slot] = window[:, 1:]
        y = (window * weight).sum(-1) + (0 if bias is None else bias)
        out[i] = F.silu(y) if activation == "silu" else y
    return out


def _standin_fused_recurrent(q, k, v, g, beta, scale, initial_state, inplace_final_state, cu_seqlens,  # type: ignore[no-untyped-def]
                             ssm_state_indices, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False):  # fmt: skip
    assert q.dim() == 4 and q.shape[0] == 1 and inplace_final_state and num_accepted_tokens is None
    assert scale == pytest.approx(q.shape[-1] ** -0.5)
    rep = v.shape[2] // q.shape[2]
    out = torch.empty_like(v)
    loc = cu_seqlens.tolist()
    for i, (lo, hi) in enumerate(zip(loc, loc[1:])):
        slot = int(ssm_state_indices[i])
        o, final = hf.torch_recurrent_gated_delta_rule(
            q[:, lo:hi].repeat_interleave(rep, 2), k[:, lo:hi].repeat_interleave(rep, 2), v[:, lo:hi], g[:, lo:hi],
            beta[:, lo:hi], initial_state=initial_state[slot][None], output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )  # fmt: skip
        out[:, lo:hi] = o
        initial_state[slot] = final[0]
    return out, initial_state


def _standin_rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):  # type: ignore[no-untyped-def]
    assert bias is None and group_size is None and norm_before_gate
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * F.silu(z)


def _standin_gating(a_log, a, dt_bias, beta=1.0, threshold=20.0):  # type: ignore[no-untyped-def]
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias, beta=beta, threshold=threshold)


@pytest.fixture
def triton_standins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process where vLLM found a working Triton, with its Triton entry points replaced by stand-ins (vLLM's FLA
    modules cannot be imported on this host: stand-in modules take their place in ``sys.modules``)."""
    import sys
    import types

    import vllm.model_executor.layers.mamba.ops.causal_conv1d as conv_ops
    import vllm.triton_utils

    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    monkeypatch.setattr(conv_ops, "causal_conv1d_update", _standin_conv_update)
    fla = types.ModuleType("vllm.model_executor.layers.fla.ops")
    fla.fused_recurrent_gated_delta_rule = _standin_fused_recurrent  # type: ignore[attr-defined]
    guard = types.ModuleType("vllm.model_executor.layers.fla.ops.layernorm_guard")
    guard.rmsnorm_fn = _standin_rmsnorm_fn  # type: ignore[attr-defined]
    model = types.ModuleType("vllm.model_executor.models.qwen3_next")
    model.fused_gdn_gating = _standin_gating  # type: ignore[attr-defined]
    for module in (fla, guard, model):
        monkeypatch.setitem(sys.modules, module.__name__, module)


@pytest.mark.usefixtures("triton_standins")
def test_npu_paths_call_the_triton_entry_points_with_the_twins_contract() -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta = _inputs(3, gen)
    pool = torch.randn(5, HV, K, V, generator=gen)
    slots, loc = torch.tensor([4, 1, 2]), torch.arange(4, dtype=torch.int32)
    ref_pool = pool.clone()
    got = fused_recurrent_gated_delta_rule_npu(q, k, v, g, beta, pool, loc, slots)
    want = fused_recurrent_gated_delta_rule_ref(q, k, v, g, beta, ref_pool, loc, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, ref_pool, rtol=1e-5, atol=1e-5)

    x, weight, bias = torch.randn(3, D, generator=gen), torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    states = torch.randn(5, D, W - 1, generator=gen)
    ref_states = states.clone()
    got = causal_conv1d_update_npu(x, states, weight, bias, "silu", slots)
    torch.testing.assert_close(got, causal_conv1d_update_ref(x, ref_states, weight, bias, "silu", slots))
    torch.testing.assert_close(states, ref_states)

    xs, zs, w = torch.randn(6, V, generator=gen), torch.randn(6, V, generator=gen), torch.randn(V, generator=gen)
    torch.testing.assert_close(rms_norm_gated_npu(xs, zs, w, 1e-6), rms_norm_gated_ref(xs, zs, w, 1e-6))
    a_log, dt_bias, a, b = (torch.randn(*s, generator=gen) for s in ((HV,), (HV,), (6, HV), (6, HV)))
    for got_t, want_t in zip(gdn_gating_npu(a_log, a, b, dt_bias), gdn_gating_ref(a_log, a, b, dt_bias)):
        torch.testing.assert_close(got_t, want_t)
