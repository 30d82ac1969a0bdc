# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The NPU twins of the MLA kernels against a stand-in ``torch.npu`` that knows torch_npu 2.8.0's binding rules.

No Ascend hardware here: the fake ops compute the kernels' documented maths in float64 and apply what the bindings and
kernels impose on top of the signatures (``npu_testkit.npu_binding_rules``, each rule with its source): the ring-MLA
kernel adds an fp16 mask as given and multiplies a bf16 mask by ``-3e38``; its mode strings, host ``seqlen`` and mask
shape; the functional ``npu_paged_cache_load`` overload's one host sync per request; an NZ weight must not be
reshaped. Each NPU twin must then equal its reference twin.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

pytest.importorskip("vllm")

from npu_testkit import npu_binding_rules as rules  # noqa: E402
from vllm_npu.attention.backends.mla import AscendMLADecodeMetadata, AscendMLAImpl  # noqa: E402
from vllm_npu.attention.ops.mla_attention import (  # noqa: E402
    mla_decode_npu,
    mla_decode_reference,
    ring_mla_mask,
    ring_mla_npu,
    ring_mla_reference,
)
from vllm_npu.attention.ops.mla_cache import (  # noqa: E402
    latent_cache_planes,
    paged_cache_load_npu,
    paged_cache_load_reference,
)
from vllm_npu.interface import recording  # noqa: E402


class FakeATB:
    """``torch_npu.atb`` with the two ops of the MLA prefill path."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.host_syncs = 0

    def npu_ring_mla(
        self,
        q_nope,
        q_rope,
        k_nope,
        k_rope,
        value,
        mask,
        seqlen,
        head_num,
        kv_head_num,
        *,
        pre_out=None,
        prev_lse=None,
        qk_scale=1.0,
        kernel_type=None,
        mask_type=None,
        input_layout=None,
        calc_type=None,
    ):
        modes = {"kernel_type": kernel_type, "mask_type": mask_type, "input_layout": input_layout}
        modes["calc_type"] = calc_type
        rules.ring_mla_call(q_nope, mask, seqlen, modes)
        self.calls.append(f"npu_ring_mla[{calc_type},{mask_type}]")
        assert head_num == kv_head_num == q_nope.shape[1] == k_rope.shape[1], "k_rope expanded to every head"
        first = calc_type == "calc_type_first_ring"
        assert (pre_out is None and prev_lse is None) if first else (pre_out is not None and prev_lse is not None)
        t, n, _ = q_nope.shape
        out = torch.zeros(t, n, value.shape[-1], dtype=torch.float64)
        lse = torch.full((n, t), float("-inf"), dtype=torch.float64)
        above = None
        if mask_type == "mask_type_triu":
            bias = rules.ring_mla_mask_bias(mask)
            assert bool((bias.tril() == 0).all()), "the triu mask is 0 on and below the diagonal"
            above = bias[0, 1]  # the kernel tiles this compressed 512 mask along the causal diagonal
        q0 = k0 = 0
        for ql, kl in zip(seqlen[0].tolist(), seqlen[1].tolist(), strict=True):
            assert ql > 0 and (kl >= ql or kl == 0), "docs: kvSeqLen >= qSeqLen or 0, qSeqLen > 0"
            if kl:
                s = torch.einsum("qnp,knp->nqk", q_nope[q0 : q0 + ql].double(), k_nope[k0 : k0 + kl].double())
                s = s + torch.einsum("qnr,knr->nqk", q_rope[q0 : q0 + ql].double(), k_rope[k0 : k0 + kl].double())
                s = s * qk_scale
                if above is not None:
                    j, i = torch.arange(kl)[None, :], torch.arange(ql)[:, None] + kl - ql
                    s = s + torch.where(j > i, above, torch.zeros((), dtype=torch.float64))
                seg = torch.logsumexp(s, -1)
                out[q0 : q0 + ql] = torch.einsum("nqk,knv->qnv", torch.softmax(s, -1), value[k0 : k0 + kl].double())
                lse[:, q0 : q0 + ql] = seg
            q0, k0 = q0 + ql, k0 + kl
        if not first:
            total = torch.logaddexp(prev_lse.double(), lse)
            w_prev = torch.exp(prev_lse.double() - total).T[..., None]
            w_new = torch.exp(lse - total).T[..., None]
            out, lse = pre_out.double() * w_prev + out * w_new, total
        return out.to(q_nope.dtype), lse.float()

    def npu_paged_cache_load(
        self, key_cache, value_cache, block_table, context_lens, *, seq_starts=None, cumsum=False, key=None, value=None
    ):
        rules.paged_cache_load_call(block_table, context_lens, seq_starts)
        assert not cumsum
        functional = key is None and value is None
        self.calls.append("npu_paged_cache_load" + ("" if functional else ".out"))
        if functional:
            self.host_syncs += context_lens.numel()  # rules.PAGED_CACHE_LOAD_SYNCS
        bs = key_cache.shape[1]
        rows_k, rows_v = [], []
        for b, n in enumerate(context_lens.tolist()):
            pos = torch.arange(n) + int(seq_starts[b])
            slots = block_table[b, pos // bs].long() * bs + pos % bs
            rows_k.append(key_cache.view(-1, *key_cache.shape[2:])[slots])
            rows_v.append(value_cache.view(-1, *value_cache.shape[2:])[slots])
        k, v = torch.cat(rows_k), torch.cat(rows_v)
        if functional:
            return k, v
        assert key.shape == k.shape and value.shape == v.shape, (key.shape, k.shape)
        key.copy_(k)
        value.copy_(v)
        return key, value


@pytest.fixture
def atb(monkeypatch) -> FakeATB:
    fake = FakeATB()
    module = types.ModuleType("torch_npu")  # both ops behind their documented 2.8.0 signatures
    module.atb = types.SimpleNamespace(
        **{op.__name__: rules.documented(op, namespace="atb") for op in (fake.npu_ring_mla, fake.npu_paged_cache_load)}
    )
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return fake


def _ring_inputs(q_lens, kv_lens, dtype, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, s = sum(q_lens), sum(kv_lens)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return r(t, n, 128), r(t, n, 64), r(s, n, 128), r(s, 1, 64), r(s, n, 128)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ring_mla_causal_first_ring_then_context(atb: FakeATB, dtype: torch.dtype) -> None:
    """A prefill chunk: the new tokens attend causally to themselves (first ring, triangular mask), then to prior
    context (default ring, no mask) merged by LSE. fp16 needs a -inf mask, bf16 a 1 flag (issue #10)."""
    q_lens, ctx_lens = [5, 1, 37], [0, 9, 140]
    mask = ring_mla_mask(dtype, "cpu")
    q_nope, q_rope, k_nope, k_rope, v = _ring_inputs(q_lens, q_lens, dtype)
    scale = 128**-0.5
    _, _, c_k, c_rope, c_v = _ring_inputs(ctx_lens, ctx_lens, dtype, seed=1)
    outs = {}
    for name, fn in (("npu", ring_mla_npu), ("ref", ring_mla_reference)):
        o, lse = fn(q_nope, q_rope, k_nope, k_rope, v, q_lens, q_lens, scale, True, mask=mask)
        outs[name] = fn(q_nope, q_rope, c_k, c_rope, c_v, q_lens, ctx_lens, scale, False, prev_out=o, prev_lse=lse)
    tol = {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(outs["npu"][0].float(), outs["ref"][0].float(), **tol)
    torch.testing.assert_close(outs["npu"][1], outs["ref"][1], atol=1e-3, rtol=1e-3)
    assert atb.calls == ["npu_ring_mla[calc_type_first_ring,mask_type_triu]", "npu_ring_mla[calc_type_default,no_mask]"]


def test_paged_cache_load_sizes_its_outputs_on_the_host(atb: FakeATB) -> None:
    """The chunk total is known on the host: the kernel writes into preallocated outputs (the ``key=``/``value=``
    form), so the binding needs no per-request ``.item()`` (issue #11)."""
    g = torch.Generator().manual_seed(3)
    nb, bs = 6, 16
    nope, rope = torch.randn(nb, bs, 1, 32, generator=g), torch.randn(nb, bs, 1, 8, generator=g)
    block_table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens, starts = torch.tensor([20, 7], dtype=torch.int32), torch.tensor([3, 16], dtype=torch.int32)
    got = paged_cache_load_npu(nope, rope, block_table, lens, starts, 27)
    want = paged_cache_load_reference(nope, rope, block_table, lens, starts, 27)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert atb.calls == ["npu_paged_cache_load.out"] and atb.host_syncs == 0


# --- the absorbed decode as a graph task ---------------------------------------------------------------------------


class FakeFIA:
    """``npu_fused_infer_attention_score.out`` (MLA mode) and its workspace query, behind their registered 2.8.0
    schemas; the decode maths of the reference, written into ``out[0]``."""

    def __init__(self) -> None:
        self.workspaces: list[torch.Tensor] = []
        self.out_calls: list[dict] = []

    def workspace(self, query, key, value, **kwargs):
        assert kwargs["query_rope"] is not None and kwargs["key_rope"] is not None
        ws = torch.empty(1024, dtype=query.dtype)
        self.workspaces.append(ws)
        return ws

    def out(self, query, key, value, *, query_rope, key_rope, block_table, block_size, actual_seq_lengths_kv,
            num_heads, num_key_value_heads, input_layout, scale, workspace, out, atten_mask=None,
            actual_seq_lengths=None, sparse_mode=0, pre_tokens=2147483647, next_tokens=2147483647,
            antiquant_scale=None, antiquant_mode=0):  # fmt: skip
        assert input_layout == "BNSD" and num_key_value_heads == 1 and key is value
        assert antiquant_scale is None and antiquant_mode == 0  # a float latent cache (C8 is GQA-only)
        # the one-token decode: no mask, no query lengths, no band (the documented defaults)
        assert atten_mask is None and actual_seq_lengths is None and sparse_mode == 0
        assert pre_tokens == next_tokens == 2147483647
        attention_out, lse = out
        self.out_calls.append({"out": attention_out, "lse": lse, "workspace": workspace})
        B, N, _, L = query.shape
        nb, _, bs, R = key_rope.shape
        result = torch.empty(B, N, L, dtype=query.dtype)
        mla_decode_reference(
            query.view(B, N, L), query_rope.view(B, N, R), key.view(nb, bs, 1, L), key_rope.view(nb, bs, 1, R),
            block_table, actual_seq_lengths_kv, scale, out=result,
        )  # fmt: skip
        attention_out.copy_(result.view(attention_out.shape))
        return attention_out, lse


@pytest.fixture
def fia(monkeypatch) -> FakeFIA:
    fake = FakeFIA()
    module = types.ModuleType("torch_npu")
    module.npu_fused_infer_attention_score = types.SimpleNamespace(
        out=rules.documented(fake.out, name="npu_fused_infer_attention_score.out")
    )
    module._npu_fused_infer_attention_score_get_max_workspace = rules.documented(
        fake.workspace, name="_npu_fused_infer_attention_score_get_max_workspace"
    )
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return fake


class _Recorder:
    def __init__(self) -> None:
        self.tasks: list[tuple] = []

    def record(self, kernel, args, params, refresh, prepare=None):
        self.tasks.append((kernel, args, dict(params), refresh))
        return kernel(*args, **params)


def _captured_decode_case() -> tuple[
    torch.Generator, types.SimpleNamespace, torch.Tensor, torch.Tensor, AscendMLADecodeMetadata
]:
    """The NPU MLA impl (documented MLA-mode shapes: 32 heads, L 512, R 64, block size 16), its latent cache planes
    and a two-request decode's metadata, shared by the captured-task tests; the generator continues the seed."""
    g = torch.Generator().manual_seed(7)
    N, P, R, L, V, bs = 32, 16, 64, 512, 16, 16
    impl = types.SimpleNamespace(
        qk_nope_head_dim=P, qk_rope_head_dim=R, scale=0.1, _npu=True, _decode=mla_decode_npu,
        W_UK_T=torch.randn(N, P, L, generator=g) * 0.05, W_UV=torch.randn(N, L, V, generator=g) * 0.05,
    )  # fmt: skip
    nope, rope = latent_cache_planes(torch.randn(5, bs, L + R, generator=g), L, R)
    meta = AscendMLADecodeMetadata(
        block_table=torch.tensor([[1, 3], [4, 2]], dtype=torch.int32), seq_lens=torch.tensor([5, 20]),
        seq_lens_list=[5, 20],
    )  # fmt: skip
    return g, impl, nope, rope, meta


def test_captured_mla_decode_task_reissues_on_its_captured_buffers(fia: FakeFIA) -> None:
    """On the NPU backend, a full-graph capture gets the decode as one task whose output, workspace and softmax_lse
    were allocated before it; re-issuing it with new sequence lengths (a task update) writes the new result into the
    same output buffer, with the same workspace."""
    g, impl, nope, rope, meta = _captured_decode_case()
    B, N, P, R, L = 2, 32, 16, 64, 512
    q = torch.randn(B, N, P + R, generator=g)
    recorder = _Recorder()
    with recording(recorder):
        captured = AscendMLAImpl._forward_decode(impl, q, nope, rope, meta, "layers.0.attn")  # type: ignore[arg-type]

    (task,) = recorder.tasks
    kernel, args, params, _ = task
    assert kernel is mla_decode_npu and params["seq_lens"] == [5, 20]
    assert params["workspace"] is fia.workspaces[0] and params["lse"].shape == (B,)
    assert fia.out_calls[0]["workspace"] is params["workspace"] and fia.out_calls[0]["lse"] is params["lse"]

    def expected(lens: list[int]) -> torch.Tensor:
        ql = torch.bmm(q[..., :P].transpose(0, 1), impl.W_UK_T).transpose(0, 1)
        latent = torch.empty(B, N, L)
        mla_decode_reference(ql, q[..., P:], nope, rope, meta.block_table, lens, 0.1, out=latent)
        return torch.bmm(latent.transpose(0, 1), impl.W_UV).transpose(0, 1)

    torch.testing.assert_close(captured, expected([5, 20]))
    # a task update: the same kernel, buffers and workspace, new lengths
    kernel(*args, **{**params, "seq_lens": [9, 31]})
    assert fia.out_calls[1]["out"].data_ptr() == params["out"].data_ptr()
    assert fia.out_calls[1]["workspace"] is params["workspace"] and len(fia.workspaces) == 1
    latent = params["out"]
    torch.testing.assert_close(torch.bmm(latent.transpose(0, 1), impl.W_UV).transpose(0, 1), expected([9, 31]))


def test_captured_mla_decode_task_group_holds_the_out_kernel_alone(fia: FakeFIA, monkeypatch) -> None:
    """Captured as an ACL graph task on the stand-in runtime (npu_testkit.fake_npu_graphs), which refuses any
    allocation inside a task group or update: the BNSD query copies (``.contiguous()`` of the absorbed query and of
    q_pe) are made before ``graph_task_group_begin``, as vllm-ascend v0.11.0 does (``mla_v1.py:1006-1012``)."""
    from npu_testkit import fake_npu_graphs
    from vllm_npu.platform.graphs import _npu
    from vllm_npu.platform.graphs._npu import NPUGraph

    monkeypatch.setattr(_npu, "_UPDATE_STREAM", [], raising=False)
    fake_npu_graphs.install(monkeypatch, torch_npu=sys.modules["torch_npu"])
    g, impl, nope, rope, meta = _captured_decode_case()
    B, N, P, R = 2, 32, 16, 64
    lens = {"now": [5, 20]}
    monkeypatch.setattr(
        "vllm_npu.attention.backends.mla.decode_seq_lens_refresh", lambda name, b: lambda: {"seq_lens": lens["now"]}
    )
    q = torch.randn(B, N, P + R, generator=g)

    def step(query: torch.Tensor) -> torch.Tensor:
        return AscendMLAImpl._forward_decode(impl, query, nope, rope, meta, "layers.0.attn")  # type: ignore[arg-type]

    graph = NPUGraph.capture(step, (q,), {}, None, None)
    assert graph.num_tasks == 1 and len(fia.workspaces) == 1
    lens["now"] = [9, 31]
    graph.refresh_tasks()  # the update re-issues the .out kernel alone, on the captured buffers
    assert [c["out"].data_ptr() for c in fia.out_calls] == [fia.out_calls[0]["out"].data_ptr()] * 2
    assert len(fia.workspaces) == 1
