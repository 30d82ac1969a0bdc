# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Layer-level tests of the DeepSeek-V3.2 override: registration, the CUDA-allocation redirect, and AscendIndexer
(built from vLLM's Indexer) against a brute-force indexer written from the math in plain loops."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_npu.interface import ConfigError, configure_kernels  # noqa: E402

H, D, ROPE, HIDDEN, Q_LORA, TOPK, BS = 4, 16, 8, 24, 12, 5, 16
PREFIX = "model.layers.3.self_attn.indexer"


@pytest.fixture(autouse=True, scope="module")
def _reference_kernels():
    configure_kernels("reference")


def test_component_declares_the_load_hook():
    from vllm_npu.models._component import COMPONENT

    assert COMPONENT.on_load == "vllm_npu.models._hooks:on_load"
    assert COMPONENT.on_worker_init is None  # the worker init runs the load hook too (registry.init_worker)


def test_register_models_is_idempotent_and_lazy():
    from vllm import ModelRegistry
    from vllm_npu.models._hooks import MODEL_OVERRIDES, register_models

    first, second = register_models(), register_models()
    assert second == []
    assert set(first) <= set(MODEL_OVERRIDES)  # empty if another test in this process registered already
    entry = ModelRegistry.models["DeepseekV32ForCausalLM"]
    # the lazy form: nothing imported, just the qualified name
    assert (entry.module_name, entry.class_name) == ("vllm_npu.models.deepseek_v32", "AscendDeepseekV32ForCausalLM")


def test_redirect_cuda_allocations_moves_only_explicit_cuda_calls():
    from vllm_npu.models.deepseek_v32 import redirect_cuda_allocations

    with redirect_cuda_allocations(torch.device("cpu")) as mode:
        buf = torch.empty(7, 3, dtype=torch.int32, device="cuda")
        other = torch.zeros(2, device=torch.device("cuda", 0))
        plain = torch.ones(2)
        meta = torch.empty(2, device="meta")
    assert (buf.device.type, buf.shape, buf.dtype) == ("cpu", (7, 3), torch.int32)
    assert other.device.type == "cpu" and plain.device.type == "cpu" and meta.device.type == "meta"
    assert mode.redirected == ["empty", "zeros"]


def test_a_config_without_index_topk_is_refused():
    from vllm_npu.models.deepseek_v32 import AscendDeepseekV32ForCausalLM

    cfg = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(num_hidden_layers=2)))
    with pytest.raises(ConfigError, match="DeepseekV3ForCausalLM"):
        AscendDeepseekV32ForCausalLM(vllm_config=cfg)


# --- AscendIndexer built from vLLM's Indexer ------------------------------------------------------------------------


@pytest.fixture
def indexers(tp1_group):
    """vLLM's Indexer (random weights) and the AscendIndexer built from it, in a fresh forward context."""
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import Indexer
    from vllm_npu.models.deepseek_v32 import AscendIndexer

    vllm_config = VllmConfig()
    hf = SimpleNamespace(index_topk=TOPK, index_n_heads=H, index_head_dim=D, qk_rope_head_dim=ROPE)
    cache_config = CacheConfig(block_size=BS)
    torch.manual_seed(0)
    with set_current_vllm_config(vllm_config):
        buffer = torch.full((32, TOPK), 99, dtype=torch.int32)
        vllm_indexer = Indexer(
            SimpleNamespace(model_config=SimpleNamespace(max_model_len=256)), hf, HIDDEN, Q_LORA, None, cache_config,
            buffer, PREFIX,
        )  # fmt: skip
        with torch.no_grad():
            for p in vllm_indexer.parameters():
                p.normal_(0.0, 0.3)
        owner = SimpleNamespace(
            compilation_config=vllm_config.compilation_config,
            cache_config=cache_config,
            model_config=SimpleNamespace(dtype=torch.float32),
        )
        old_cache = vllm_indexer.k_cache
        ascend = AscendIndexer.from_vllm(vllm_indexer, owner)
    return vllm_indexer, ascend, old_cache, vllm_config.compilation_config.static_forward_context


def test_from_vllm_takes_over_modules_names_and_cache_layer(indexers):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    from vllm_npu.attention import AscendSFAIndexerBackend
    from vllm_npu.models.deepseek_v32 import AscendIndexerKeyCache

    vllm_indexer, ascend, old_cache, ctx = indexers
    # same parameter objects under the same names: the checkpoint's indexer weights load unchanged
    assert dict(ascend.named_parameters()).keys() == dict(vllm_indexer.named_parameters()).keys()
    assert all(a is b for a, b in zip(ascend.parameters(), vllm_indexer.parameters(), strict=True))
    assert ascend.topk_indices_buffer is vllm_indexer.topk_indices_buffer
    assert (ascend.n_head, ascend.head_dim, ascend.rope_dim, ascend.topk_tokens) == (H, D, ROPE, TOPK)
    assert ascend.softmax_scale == vllm_indexer.softmax_scale == D**-0.5
    # vLLM's fp8 cache layer is gone from the forward context; ours holds its name
    assert ctx[f"{PREFIX}.k_cache"] is ascend.k_cache and ascend.k_cache is not old_cache
    assert all(v is not old_cache for v in ctx.values())
    assert isinstance(ascend.k_cache, AscendIndexerKeyCache)
    assert ascend.k_cache.get_attn_backend() is AscendSFAIndexerBackend
    assert ascend.k_cache.get_kv_cache_spec() == MLAAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=D, dtype=torch.float32
    )


def _gptj_rope(x: torch.Tensor, pos: int) -> torch.Tensor:
    """GPT-J rotation of one vector's first ROPE channels (pairs 2i, 2i+1), base 10000, float64, by loops."""
    out = x.clone()
    for i in range(ROPE // 2):
        ang = pos * 10000.0 ** (-2 * i / ROPE)
        cos, sin = math.cos(ang), math.sin(ang)
        a, b = float(x[2 * i]), float(x[2 * i + 1])
        out[2 * i] = a * cos - b * sin
        out[2 * i + 1] = b * cos + a * sin
    return out


def _brute_force_scores(vi, x: torch.Tensor, qr: torch.Tensor, t: int, upto: int) -> list[float]:
    """score(t, s) for s in 0..upto from the indexer's weights: loops over heads, float64."""
    W = {n: p.detach().double() for n, p in vi.named_parameters()}
    q = (W["wq_b.weight"] @ qr[t].double()).view(H, D)
    w = (W["weights_proj.weight"] @ x[t].double() + W["weights_proj.bias"]) * D**-0.5 * H**-0.5
    scores = []
    for s in range(upto + 1):
        k = torch.nn.functional.layer_norm(
            W["wk.weight"] @ x[s].double(), (D,), W["k_norm.weight"], W["k_norm.bias"], 1e-6
        )
        k = torch.cat([_gptj_rope(k[:ROPE], s), k[ROPE:]])
        total = 0.0
        for h in range(H):
            qh = torch.cat([_gptj_rope(q[h, :ROPE], t), q[h, ROPE:]])
            total += float(w[h]) * max(0.0, float(qh @ k))
        scores.append(total)
    return scores


def test_forward_selects_what_a_brute_force_indexer_selects(indexers):
    """Two steps of one request: a 7-token prefill, then 3 tokens with those 7 cached (blocks [2, 0], block size
    16). Each step's selection (rows of topk_indices_buffer) is a top-5 of the brute-force scores."""
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers.rotary_embedding import get_rope

    vllm_indexer, ascend, _, _ = indexers
    rope = get_rope(ROPE, rotary_dim=ROPE, max_position=256, base=10000, is_neox_style=False)
    ascend.bind_rotary_emb(rope)
    ascend.k_cache.kv_cache = [torch.zeros(4, BS, D)]
    x, qr = torch.randn(10, HIDDEN), torch.randn(10, Q_LORA)
    steps = [(0, 7), (7, 10)]
    for start, end in steps:
        n = end - start
        meta = SimpleNamespace(
            num_actual_tokens=n, slot_mapping=torch.arange(start, end) + 2 * BS,
            block_table=torch.tensor([[2, 0]], dtype=torch.int32), query_start_loc_list=[0, n], seq_lens_list=[end],
        )  # fmt: skip
        ctx = ForwardContext(
            no_compile_layers={ascend.k_cache.prefix: ascend.k_cache},
            attn_metadata={ascend.k_cache.prefix: meta},
            virtual_engine=0,
        )
        with override_forward_context(ctx), torch.no_grad():
            out = ascend(x[start:end], qr[start:end], torch.arange(start, end), rope)  # through the custom op
        assert out is ascend.topk_indices_buffer
        for row, t in zip(out[:n].tolist(), range(start, end), strict=True):
            chosen = [i for i in row if i >= 0]
            scores = _brute_force_scores(vllm_indexer, x, qr, t, t)
            assert len(chosen) == len(set(chosen)) == min(TOPK, t + 1)
            assert row[len(chosen) :] == [-1] * (TOPK - len(chosen))
            rest = [v for s, v in enumerate(scores) if s not in chosen]
            assert not rest or min(scores[s] for s in chosen) > max(rest), (t, chosen, scores)
        if start == 0:
            assert torch.all(out[n:] == 99)  # rows past the step's tokens are not the indexer's to write
    with pytest.raises(ConfigError, match="rotary embedding"):
        ascend(
            x[:1],
            qr[:1],
            torch.arange(1),
            get_rope(ROPE, rotary_dim=ROPE, max_position=256, base=500, is_neox_style=False),
        )


def test_a_functionalized_graph_keeps_the_indexer_selection(indexers):
    """The torchair mode compiles the decode forward through AOTAutograd, which hands the indexer op a copy of the
    topk buffer and writes the copy back afterwards: the selection must survive that write-back (the eager result),
    and a buffer of another shape is refused."""
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.layers.rotary_embedding import get_rope

    _, ascend, _, _ = indexers
    rope = get_rope(ROPE, rotary_dim=ROPE, max_position=256, base=10000, is_neox_style=False)
    ascend.bind_rotary_emb(rope)
    ascend.k_cache.kv_cache = [torch.zeros(4, BS, D)]
    x, qr, positions = torch.randn(6, HIDDEN), torch.randn(6, Q_LORA), torch.arange(6)
    meta = SimpleNamespace(
        num_actual_tokens=6, slot_mapping=torch.arange(6) + 2 * BS, block_table=torch.tensor([[2]], dtype=torch.int32),
        query_start_loc_list=[0, 6], seq_lens_list=[6],
    )  # fmt: skip
    ctx = ForwardContext(
        no_compile_layers={ascend.k_cache.prefix: ascend.k_cache},
        attn_metadata={ascend.k_cache.prefix: meta},
        virtual_engine=0,
    )
    with override_forward_context(ctx), torch.no_grad():
        eager = ascend(x, qr, positions, rope)[:6].clone()
        ascend.topk_indices_buffer.fill_(99)
        ascend.k_cache.kv_cache[0].zero_()
        torch._dynamo.reset()
        compiled = torch.compile(lambda a, b, c: ascend(a, b, c, rope), backend="aot_eager", fullgraph=True)
        compiled(x, qr, positions)
        assert torch.equal(ascend.topk_indices_buffer[:6], eager)
        with pytest.raises(ConfigError, match="topk buffer"):
            torch.ops.vllm.npu_dsa_lightning_indexer(
                x, qr, positions, torch.zeros(3, TOPK, dtype=torch.int32), ascend.k_cache.prefix
            )
    torch._dynamo.reset()
