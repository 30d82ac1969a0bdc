# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Linear, embedding, LM head and logits overrides: built through vLLM's classes on a one-rank process group,
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_classes_use_npu_method(ctx, dtype) -> None:
    from vllm.model_executor.layers import linear as L
    from vllm_npu.ops import linear as ours

    g = torch.Generator().manual_seed(0)
    hidden, heads, kv, head = 40, 4, 2, 10
    layers = {
        "replicated": (L.ReplicatedLinear(hidden, 24, bias=True, params_dtype=dtype), ours.NPUReplicatedLinear, 24),
        "column": (L.ColumnParallelLinear(hidden, 36, bias=True, params_dtype=dtype), ours.NPUColumnParallelLinear, 36),
        "merged": (
            L.MergedColumnParallelLinear(hidden, [22, 22], bias=False, params_dtype=dtype),
            ours.NPUMergedColumnParallelLinear,
            44,
        ),
        "qkv": (
            L.QKVParallelLinear(hidden, head, heads, kv, bias=True, params_dtype=dtype),
            ours.NPUQKVParallelLinear,
            (heads + 2 * kv) * head,
        ),
        "row": (L.RowParallelLinear(hidden, 30, bias=True, params_dtype=dtype), ours.NPURowParallelLinear, 30),
    }
    x = torch.randn(3, hidden, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    for name, (layer, cls, out_features) in layers.items():
        assert type(layer) is cls, name
        assert type(layer.quant_method) is ours.NPUUnquantizedLinearMethod, name
        w = torch.randn(out_features, hidden, generator=g).to(dtype)
        b = torch.randn(out_features, generator=g).to(dtype) if layer.bias is not None else None
        _load(layer, w, b)
        out, out_bias = layer(x)
        assert out_bias is None
        expected = x.float() @ w.float().T + (0 if b is None else b.float())
        torch.testing.assert_close(out.float(), expected, atol=tol * 4, rtol=tol, msg=name)


def test_quantized_layers_keep_their_method(ctx) -> None:
    from vllm.model_executor.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod
    from vllm_npu.ops.linear import NPUUnquantizedLinearMethod, _use_npu_method

    class OtherMethod(UnquantizedLinearMethod):  # e.g. a LoRA or quant plugin's subclass
        pass

    layer = ColumnParallelLinear(8, 8)
    layer.quant_method = OtherMethod()
    _use_npu_method(layer)
    assert type(layer.quant_method) is OtherMethod
    assert not isinstance(layer.quant_method, NPUUnquantizedLinearMethod)


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
