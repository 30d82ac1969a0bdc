# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Embedding, LM head and logits overrides (and vLLM's linear layers, which stay vLLM's): built through vLLM's classes on a one-rank process group,
compared with plain PyTorch math and vLLM's own code paths (fp32 exact-ish: atol = rtol = 1e-5; bf16 1.6e-2)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def ctx(vllm_ctx, tp1_group):
    return vllm_ctx


def _load(layer: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    layer.quant_method.process_weights_after_loading(layer)


def test_linear_layers_stay_vllm_s(ctx) -> None:
    """No linear override: vLLM's classes and UnquantizedLinearMethod keep float weights ND (see ``_registry``)."""
    from vllm.model_executor.layers import linear as L
    from vllm_npu.ops._registry import OOT_OPS

    assert not any(name.endswith("Linear") for name in OOT_OPS)
    layer = L.RowParallelLinear(16, 8, bias=False)
    assert type(layer) is L.RowParallelLinear and type(layer.quant_method) is L.UnquantizedLinearMethod


def test_embedding_lm_head_and_logits(ctx) -> None:
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm_npu.ops import vocab_parallel_embedding as ours

    vocab, hidden = 1000, 24  # padded to 1024 rows
    emb = VocabParallelEmbedding(vocab, hidden)
    head = ParallelLMHead(vocab, hidden)
    proc = LogitsProcessor(vocab, soft_cap=30.0, scale=0.5)
    assert type(emb) is ours.NPUVocabParallelEmbedding and type(head) is ours.NPUParallelLMHead
    assert type(proc) is ours.NPULogitsProcessor
    g = torch.Generator().manual_seed(1)
    table = torch.randn(emb.weight.shape, generator=g)
    with torch.no_grad():
        emb.weight.copy_(table)
        head.weight.copy_(table)
    ids = torch.tensor([0, 5, 999, 17])
    torch.testing.assert_close(emb(ids), table[ids])
    torch.testing.assert_close(emb(ids), VocabParallelEmbedding.forward_native(emb, ids))

    hidden_states = torch.randn(4, hidden, generator=g)
    logits = proc(head, hidden_states)
    expected = torch.tanh((hidden_states @ table.T)[:, :vocab] / 30.0) * 30.0 * 0.5
    assert logits.shape == (4, vocab)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, LogitsProcessor.forward(proc, head, hidden_states), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError):
        head(ids)


def test_masked_vocab_input_matches_vllm() -> None:
    """The eager TP masking equals vLLM's compiled helper on a shard with added vocab."""
    from vllm.model_executor.layers.vocab_parallel_embedding import get_masked_input_and_mask
    from vllm_npu.ops.vocab_parallel_embedding import masked_vocab_input

    vllm_fn = getattr(get_masked_input_and_mask, "_torchdynamo_orig_callable", get_masked_input_and_mask)
    ids = torch.arange(0, 1200)
    for args in [(256, 512, 0, 1100, 1110), (512, 1000, 24, 1100, 1150), (0, 256, 0, 1000, 1000)]:
        ours_ids, ours_mask = masked_vocab_input(ids, *args)
        ref_ids, ref_mask = vllm_fn(ids, *args)
        assert torch.equal(ours_mask, ref_mask), args
        assert torch.equal(ours_ids, ref_ids), args
