# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""AscendSFABackend and the lightning indexer against dense references.

- top-k >= every sequence length: the indexer selects every causal token, so sparse attention equals dense MLA;
- small top-k: equals dense attention restricted (by a mask) to the tokens a brute-force indexer picks.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from mla_harness import assert_close, dense_reference, make_scenario, make_sfa_impl, step_inputs  # noqa: E402
from vllm_npu.attention.backends.sfa import AscendSFABackend, AscendSFAImpl, AscendSFAMetadataBuilder  # noqa: E402
from vllm_npu.attention.backends.sfa_indexer import AscendLightningIndexer, AscendSFAIndexerBackend  # noqa: E402
from vllm_npu.attention.ops.sfa_kernels import indexer_cache_write_reference, lightning_indexer_reference  # noqa: E402
from vllm_npu.interface import configure_kernels  # noqa: E402

H_IDX, D_IDX = 3, 16  # indexer heads and head dim


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    configure_kernels("reference")


def indexer_inputs(s, seed: int):
    """Random indexer q/k/weights for every position of every request (k for all, q for the new tokens)."""
    g = torch.Generator().manual_seed(seed + 100)
    ks = [torch.randn(c + ql, D_IDX, generator=g) for c, ql in s.reqs]
    qs = [torch.randn(ql, H_IDX, D_IDX, generator=g) for _, ql in s.reqs]
    ws = [torch.rand(ql, H_IDX, generator=g) + 0.1 for _, ql in s.reqs]
    return qs, ks, ws


def run_sfa(s, topk: int, seed: int, fill: float = 7.0):
    """One SFA layer step; the output buffer starts filled with ``fill``."""
    d = s.dims
    q, kv_c, k_pe, slot_mapping, common = step_inputs(s)
    n = common.num_actual_tokens
    spec = SimpleNamespace(block_size=s.block_size)
    meta = AscendSFAMetadataBuilder(spec, ["x"], None, torch.device("cpu")).build(0, common)

    # indexer: cache holds the context keys from earlier steps; this step writes the new ones and selects
    qs, ks, ws = indexer_inputs(s, seed)
    idx_cache = torch.zeros(s.kv_cache.shape[0], s.block_size, D_IDX)
    for b, (c, _) in enumerate(s.reqs):
        indexer_cache_write_reference(ks[b][:c], idx_cache, s.slots[b][:c])
    buffer = torch.full((n + s.pad + 4, topk), 12345, dtype=torch.int32)
    k_new = torch.cat([ks[b][c:] for b, (c, _) in enumerate(s.reqs)] + [torch.randn(s.pad, D_IDX)])
    q_idx = torch.cat(qs + [torch.randn(s.pad, H_IDX, D_IDX)])
    w_idx = torch.cat(ws + [torch.rand(s.pad, H_IDX)])
    AscendLightningIndexer(topk)(q_idx, k_new, w_idx, idx_cache, meta, buffer)

    impl = make_sfa_impl(s, buffer)
    impl.process_weights_after_loading(q.dtype)
    output = torch.full((q.shape[0], d.N * d.V), fill, dtype=q.dtype)
    impl.forward(None, q, kv_c, k_pe, s.kv_cache, meta, output=output)
    return output, buffer, (qs, ks, ws), n


def brute_force_scores(s, qs, ks, ws) -> list[list[list[float]]]:
    """Per request, per new token: the indexer score of every causal position (loops, float64)."""
    out = []
    for b, (c, ql) in enumerate(s.reqs):
        out.append([
            [sum(float(ws[b][i, h]) * max(0.0, float(qs[b][i, h].double() @ ks[b][j].double())) for h in range(H_IDX))
             for j in range(c + i + 1)]
            for i in range(ql)
        ])  # fmt: skip
    return out


@pytest.mark.parametrize("block_size", [16, 128])
def test_topk_covering_the_sequence_equals_dense_mla(block_size: int) -> None:
    s = make_scenario([(60, 1), (0, 1), (33, 17), (0, 25)], block_size, seed=11, pad=3)
    topk = 128  # >= every sequence length (max 60 + 1)
    out, buffer, _, n = run_sfa(s, topk, seed=11)
    assert_close(s, out[:n], dense_reference(s))
    assert torch.all(out[n:] == 0), "padded rows are zeroed (fills_output_buffer)"
    assert torch.all(buffer[n:] == 12345), "rows past the step's tokens are not the indexer's to write"


@pytest.mark.parametrize("block_size", [16, 128])
def test_small_topk_equals_masked_dense(block_size: int) -> None:
    s = make_scenario([(40, 1), (21, 6), (0, 12)], block_size, seed=12)
    topk = 8
    out, buffer, (qs, ks, ws), n = run_sfa(s, topk, seed=12)
    scores = [t for req in brute_force_scores(s, qs, ks, ws) for t in req]
    got = [set(r[r >= 0].tolist()) for r in buffer[:n]]
    for chosen, sc in zip(
        got, scores, strict=True
    ):  # a valid top-k (ties, e.g. several all-zero ReLU scores, may go either way)
        assert len(chosen) == min(topk, len(sc)) and max(chosen) < len(sc)
        rest = [v for j, v in enumerate(sc) if j not in chosen]
        assert not rest or min(sc[j] for j in chosen) >= max(rest) - 1e-4
    selection, t = [], 0
    for _, ql in s.reqs:
        selection.append(got[t : t + ql])
        t += ql
    assert_close(s, out[:n], dense_reference(s, selection))


def test_lightning_indexer_pads_with_minus_one() -> None:
    cache = torch.randn(4, 16, D_IDX)
    bt = torch.tensor([[2, 1]], dtype=torch.int32)
    idx = lightning_indexer_reference(torch.randn(3, H_IDX, D_IDX), torch.rand(3, H_IDX), cache, bt, [0, 3], [5], 6)
    # tokens at positions 2, 3, 4 see 3, 4, 5 candidates
    assert [int((r >= 0).sum()) for r in idx] == [3, 4, 5]
    assert all(int(r[r >= 0].max()) <= p for r, p in zip(idx, [2, 3, 4], strict=True))


def test_sfa_needs_an_indexer() -> None:
    with pytest.raises(ValueError, match="indexer"):
        AscendSFAImpl(
            4, 48, 0.1, 1, None, None, "auto", None, "decoder", None,
            q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16,
            qk_head_dim=40, v_head_dim=20, kv_b_proj=None,
        )  # fmt: skip


def test_declarations() -> None:
    assert AscendSFABackend.get_name() == "ASCEND_SFA"
    assert AscendSFABackend.get_impl_cls() is AscendSFAImpl
    assert AscendSFAIndexerBackend.get_kv_cache_shape(7, 16, 1, 128) == (7, 16, 128)
    assert math.prod(AscendSFABackend.get_kv_cache_shape(7, 16, 1, 576)) == 7 * 16 * 576


def test_ascend_indexer_forward_follows_vllm_indexer_math() -> None:
    """``ascend_indexer_forward`` = vLLM 0.11's Indexer.forward (rope channels first, GPT-J rope, weights scaled by
    softmax_scale / sqrt(H)) in the model dtype, then the lightning indexer; checked against a hand-written loop."""
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers.rotary_embedding.common import apply_rotary_emb_torch
    from vllm_npu.attention.backends.sfa_indexer import ascend_indexer_forward

    torch.manual_seed(5)
    hidden, q_lora, H, D, rope_dim, bs = 24, 12, 2, 8, 4, 16

    class Lin(torch.nn.Linear):
        def forward(self, x):  # vLLM linear layers return (output, bias)
            return super().forward(x), None

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2).float() / rope_dim))

    def rotary_emb(positions, q, k):  # vLLM's DeepSeek rope: GPT-J style on [T, heads, rope_dim]
        f = positions.float()[:, None] * inv_freq[None, :]
        return apply_rotary_emb_torch(q, f.cos(), f.sin(), False), apply_rotary_emb_torch(k, f.cos(), f.sin(), False)

    # the two fields of the key cache layer (npu-models' AscendIndexerKeyCache) that the forward reads
    cache_layer = SimpleNamespace(prefix="layers.0.indexer.k_cache", kv_cache=[torch.zeros(4, bs, D)])
    indexer = SimpleNamespace(
        wq_b=Lin(q_lora, H * D, bias=False), wk=Lin(hidden, D, bias=False), k_norm=torch.nn.LayerNorm(D),
        weights_proj=Lin(hidden, H, bias=False), n_head=H, head_dim=D, rope_dim=rope_dim, softmax_scale=D**-0.5,
        k_cache=cache_layer, topk_indices_buffer=torch.full((8, 4), 99, dtype=torch.int32),
    )  # fmt: skip
    # one request, 3 cached tokens (written earlier) + 3 new ones at positions 3..5, blocks [2]
    x_all, qr_all = torch.randn(6, hidden), torch.randn(6, q_lora)
    pos_all = torch.arange(6)
    with torch.no_grad():
        k_all = indexer.k_norm(indexer.wk(x_all)[0])
        kp, kn = k_all.split([rope_dim, D - rope_dim], -1)
        k_all = torch.cat([rotary_emb(pos_all, kp.unsqueeze(1), kp.unsqueeze(1))[1].squeeze(1), kn], -1)
        cache_layer.kv_cache[0][2, :3] = k_all[:3]

        meta = SimpleNamespace(
            num_actual_tokens=3, slot_mapping=torch.tensor([2 * bs + 3, 2 * bs + 4, 2 * bs + 5]),
            block_table=torch.tensor([[2]], dtype=torch.int32), query_start_loc_list=[0, 3], seq_lens_list=[6],
        )  # fmt: skip
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={cache_layer.prefix: meta}, virtual_engine=0)
        with override_forward_context(ctx):
            out = ascend_indexer_forward(
                indexer, x_all[3:], qr_all[3:], pos_all[3:], rotary_emb, AscendLightningIndexer(4)
            )

        torch.testing.assert_close(cache_layer.kv_cache[0][2, :6], k_all)
        q = indexer.wq_b(qr_all[3:])[0].view(3, H, D)
        qp, qn = q.split([rope_dim, D - rope_dim], -1)
        q = torch.cat([rotary_emb(pos_all[3:], qp, qp)[0], qn], -1)
        w = indexer.weights_proj(x_all[3:])[0] * D**-0.5 * H**-0.5
        for t in range(3):
            p = 3 + t
            score = torch.stack([(w[t] * (q[t] @ k_all[j]).relu()).sum() for j in range(p + 1)])
            chosen = set(out[t][out[t] >= 0].tolist())
            assert len(chosen) == min(4, p + 1)
            rest = [float(score[j]) for j in range(p + 1) if j not in chosen]
            assert not rest or min(float(score[j]) for j in chosen) >= max(rest) - 1e-5
        assert torch.all(out[3:] == 99)
