# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""attention-output-empty: the patched ``Attention.forward`` returns what vLLM's returns, allocates its output with
``torch.empty`` (no zero-fill op) only for impls that declare ``fills_output_buffer``, and is vLLM's forward
(zero-fill included) for every other impl.

"Empty is safe" is shown by poisoning: the buffer the patched forward hands to a declaring impl is pre-filled with
NaN, and the result equals vLLM's zero-initialised result, i.e. every element was overwritten.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from vllm_npu.patches import PatchRegistry
from vllm_npu.patches.sets import ATTENTION_OUTPUT_EMPTY

pytestmark = pytest.mark.usefixtures("vllm_unpatched")

T, N, NKV, D = 5, 4, 2, 8
FILL_OPS = {
    "aten.zeros.default",
    "aten.zero_.default",
    "aten.fill_.Scalar",
    "aten.full.default",
    "aten.new_zeros.default",
}


class FullImpl:
    """Writes every element of ``output``: causal GQA attention over the step's tokens (any fully-writing impl)."""

    fills_output_buffer = True

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, **_: Any):
        k = key.repeat_interleave(N // NKV, dim=1)
        v = value.repeat_interleave(N // NKV, dim=1)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        output.copy_(out.transpose(0, 1))
        return output


class PartialImpl(FullImpl):
    """Writes only the first ``attn_metadata`` rows (like vLLM's backends with padded tokens); declares nothing."""

    fills_output_buffer = False

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, **_: Any):
        full = torch.empty_like(output)
        super().forward(layer, query, key, value, kv_cache, attn_metadata, output=full)
        output[:attn_metadata] = full[:attn_metadata]
        return output


class FakeLayer:
    """The attributes of ``vllm.attention.layer.Attention`` that its forward reads."""

    def __init__(self, impl: Any, direct: bool = True) -> None:
        self.impl = impl
        self.use_output = True
        self.calculate_kv_scales = False
        self.query_quant = None
        self.use_mla = False
        self.use_direct_call = direct
        self.num_heads, self.num_kv_heads, self.head_size = N, NKV, D
        self.layer_name = "model.layers.0.self_attn.attn"
        self.kv_cache = [torch.empty(0)]


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def qkv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(T, N * D, generator=g),
        torch.randn(T, NKV * D, generator=g),
        torch.randn(T, NKV * D, generator=g),
    )


def run(forward, layer, metadata=T):
    from vllm.forward_context import ForwardContext, override_forward_context

    ctx = ForwardContext(
        no_compile_layers={layer.layer_name: layer}, attn_metadata={layer.layer_name: metadata}, virtual_engine=0
    )
    with override_forward_context(ctx), Ops() as ops:
        out = forward(layer, *qkv())
    return out, ops.names


@pytest.fixture
def patched():
    from vllm.attention.layer import Attention

    original = Attention.forward
    reg = PatchRegistry([ATTENTION_OUTPUT_EMPTY])
    reg.apply("worker", environ={})
    yield original, Attention.forward
    reg.revert()
    assert Attention.forward is original


@pytest.mark.parametrize("direct", [True, False], ids=["direct-call", "custom-op"])
def test_declaring_impl_gets_an_unfilled_buffer_and_the_same_result(patched, direct):
    original, forward = patched
    want, want_ops = run(original, FakeLayer(FullImpl(), direct))
    got, got_ops = run(forward, FakeLayer(FullImpl(), direct))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.shape == (T, N * D)
    assert "aten.zeros.default" in want_ops  # vLLM 0.11.0 zero-fills
    assert not FILL_OPS & set(got_ops), sorted(FILL_OPS & set(got_ops))
    assert "aten.empty.memory_format" in got_ops


def test_empty_is_safe_every_element_is_overwritten(patched, monkeypatch):
    """Poison the buffer the patched forward allocates: a declaring impl must leave no NaN behind."""
    import vllm_npu.patches.sets.attention_output as mod

    original, forward = patched
    real_new_output = mod.new_output
    poisoned = []

    def nan_output(*args: Any) -> torch.Tensor:
        poisoned.append(args)
        return real_new_output(*args).fill_(float("nan"))

    monkeypatch.setattr(mod, "new_output", nan_output)
    got, _ = run(forward, FakeLayer(FullImpl()))
    monkeypatch.undo()
    want, _ = run(original, FakeLayer(FullImpl()))
    assert poisoned, "the patched forward did not allocate through new_output"
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_non_declaring_impl_keeps_vllms_zero_fill(patched):
    original, forward = patched
    want, _ = run(original, FakeLayer(PartialImpl()), metadata=3)
    got, got_ops = run(forward, FakeLayer(PartialImpl()), metadata=3)
    assert "aten.zeros.default" in got_ops
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.count_nonzero(got[3:]) == 0  # padded rows stay zero, as in vLLM


@pytest.mark.parametrize("attr", ["calculate_kv_scales", "query_quant", "not_use_output"])
def test_paths_the_patch_does_not_own_go_to_vllm(patched, attr):
    original, forward = patched
    layer = FakeLayer(FullImpl())
    calls = []
    if attr == "not_use_output":
        layer.use_output = False
    else:
        setattr(layer, attr, object())
    # vLLM's forward is the only thing that may run: observe it by wrapping the original the patch captured.
    wrapped = forward.__wrapped__
    assert wrapped is original
    import vllm_npu.patches.sets.attention_output as mod

    spy_forward = mod.make_replacement(lambda *a: calls.append(a) or "vllm")
    assert spy_forward(layer, *qkv()) == "vllm" and len(calls) == 1
