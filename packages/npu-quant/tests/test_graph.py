# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Each scheme's linear forward traced into a compiled decode graph the way the torchair mode compiles it on an NPU.

``torch.compile(fullgraph=True, dynamic=True)`` with every tensor marked static, the scheme's forward kernels swapped
for their NPU twins and ``torch_npu`` replaced by opaque custom ops in the ``npu`` namespace (the real ops' names, so
the lowered graph's node names are the converter table's) with the documented arguments. Their bodies are the
reference twins, which :mod:`test_schemes` checks against float maths and an independent simulation: what this test
adds is the graph. The compiled forward equals the eager reference over three inputs of one shape, compiles once,
reads nothing on the host, has no symbolic input, and every op of it has an implemented GE converter in torch_npu
2.8.0's bundled torchair (read from the wheel). Load-time kernels (``npu_trans_quant_param``,
``npu_convert_weight_to_int4pack``) run at load, outside the graph, and stay the reference ones here.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import pytest
import torch
from npu_testkit.torchair_converters import (
    compile_lowered,
    fresh_dynamo_imports,
    graph_ops,
    missing_converters,
    symbolic_inputs,
)
from vllm_npu.interface import Kernel
from vllm_npu.quant import kernels as K
from vllm_npu.quant.config import AscendQuantConfig
from vllm_npu.quant.description import QuantDescription
from vllm_npu.quant.quantize_math import (
    flatquant_transforms,
    quantize_w4a4_flatquant,
    quantize_w4a8,
    quantize_w8a8,
    quantize_w8a8_dynamic,
)

IN, OUT, PREFIX = 128, 64, "model.layers.0.mlp.down_proj"


@functools.cache
def _register_npu_ops() -> None:
    """The forward ops of the schemes as ``torch.ops.npu.*`` custom ops (the bodies: the reference twins)."""
    lib = "npu::"

    @torch.library.custom_op(lib + "npu_quantize", mutates_args=())
    def quantize(
        x: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, dtype: torch.dtype, axis: int, div_mode: bool
    ) -> torch.Tensor:
        assert dtype == torch.qint8 and axis == -1 and not div_mode  # multiply mode, per channel of the last dim
        return K._quantize_ref(x, scales, zero_points)

    quantize.register_fake(lambda x, s, z, dtype, axis, div: torch.empty_like(x, dtype=torch.int8))

    @torch.library.custom_op(lib + "npu_dynamic_quant", mutates_args=())
    def dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return K._dynamic_quant_ref(x)

    dynamic_quant.register_fake(
        lambda x: (torch.empty_like(x, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32))
    )

    @torch.library.custom_op(lib + "npu_quant_matmul", mutates_args=())
    def quant_matmul(
        x1: torch.Tensor,
        x2: torch.Tensor,
        scale: torch.Tensor,
        pertoken_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
        output_dtype: torch.dtype,
    ) -> torch.Tensor:
        return K._quant_matmul_ref(x1, x2, scale, pertoken_scale, bias, output_dtype)

    @quant_matmul.register_fake
    def _(x1, x2, scale, pertoken_scale, bias, output_dtype):
        return x1.new_empty(x1.shape[0], x2.shape[-1], dtype=output_dtype)  # x2 [K, N] int8 or [K/8, N] int32

    @torch.library.custom_op(lib + "npu_weight_quant_batchmatmul", mutates_args=())
    def weight_quant_bmm(
        x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor, antiquant_group_size: int
    ) -> torch.Tensor:
        return K._weight_quant_bmm_ref(x, weight, antiquant_scale, antiquant_group_size)

    weight_quant_bmm.register_fake(lambda x, w, s, g: x.new_empty(x.shape[0], w.shape[-1] * 8))

    @torch.library.custom_op(lib + "npu_kronecker_quant", mutates_args=())
    def kronecker_quant(
        x: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, clip_ratio: float, dst_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert dst_dtype == torch.int32  # the converter takes int32 only
        return K._kronecker_quant_ref(x, p1, p2, clip_ratio)

    kronecker_quant.register_fake(
        lambda x, p1, p2, c, d: (
            x.new_empty(*x.shape[:-1], x.shape[-1] // 8, dtype=torch.int32),
            x.new_empty(x.shape[0], dtype=torch.float32),
        )
    )


@functools.cache
def _fake_torch_npu() -> types.ModuleType:
    _register_npu_ops()
    ops = torch.ops.npu
    m = types.ModuleType("torch_npu")  # a module: Dynamo traces the twins' `import torch_npu`

    def npu_quantize(x, scales, zero_points, dtype, axis=1, div_mode=True):
        return ops.npu_quantize(x, scales, zero_points, dtype, axis, div_mode)

    def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=torch.int8):
        assert smooth_scales is None and group_index is None and dst_type == torch.int8
        return ops.npu_dynamic_quant(x)

    def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
        assert offset is None
        return ops.npu_quant_matmul(x1, x2, scale, pertoken_scale, bias, output_dtype)

    def npu_weight_quant_batchmatmul(
        x,
        weight,
        antiquant_scale,
        antiquant_offset=None,
        quant_scale=None,
        quant_offset=None,
        bias=None,
        antiquant_group_size=0,
        inner_precise=0,
    ):
        assert antiquant_offset is None and quant_scale is None and quant_offset is None and bias is None
        return ops.npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_group_size)

    def npu_kronecker_quant(x, kronecker_p1, kronecker_p2, clip_ratio=1.0, dst_dtype=torch.int32):
        return ops.npu_kronecker_quant(x, kronecker_p1, kronecker_p2, clip_ratio, dst_dtype)

    for fn in (npu_quantize, npu_dynamic_quant, npu_quant_matmul, npu_weight_quant_batchmatmul, npu_kronecker_quant):
        setattr(m, fn.__name__, fn)
    return m


def _layer(qtype: str, dtype: torch.dtype) -> torch.nn.Module:
    """A row-parallel linear of ``qtype`` through vLLM's loaders and the scheme's load-time processing."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    g = torch.Generator().manual_seed(2)
    w = torch.randn(OUT, IN, generator=g) * 0.2
    if qtype == "W8A8_DYNAMIC":
        tensors = quantize_w8a8_dynamic(w, dtype)
    elif qtype == "W8A8":
        tensors = quantize_w8a8(w, None, -3.0, 3.0, dtype)
    elif qtype == "W4A8_DYNAMIC":
        tensors = quantize_w4a8(w, 32, "0", True, dtype)
    else:
        left, right = flatquant_transforms(IN, seed=3)
        tensors = quantize_w4a4_flatquant(w, left, right, 1.0, dtype)
    entries: dict[str, Any] = {f"{PREFIX}.{s}": qtype for s in tensors}
    cfg = AscendQuantConfig(QuantDescription.from_mapping({**entries, "group_size": 32, "version": "0"}))
    layer = RowParallelLinear(IN, OUT, bias=False, params_dtype=dtype, quant_config=cfg, prefix=PREFIX)
    params = dict(layer.named_parameters())
    for suffix, t in tensors.items():
        params[suffix].weight_loader(params[suffix], t)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _npu_twins(scheme: object) -> list[str]:
    """Swap the scheme's selected forward kernels for their NPU twins (as ``select()`` does on an NPU)."""
    twins = {k.reference: k.npu for k in vars(K).values() if isinstance(k, Kernel)}
    swapped = []
    for name, value in list(vars(scheme).items()):
        if value in twins:
            setattr(scheme, name, twins[value])
            swapped.append(name)
    return swapped


SCHEMES = {
    "W8A8": {"npu.npu_quantize.default", "npu.npu_quant_matmul.default"},
    "W8A8_DYNAMIC": {"npu.npu_dynamic_quant.default", "npu.npu_quant_matmul.default"},
    "W4A8_DYNAMIC": {"npu.npu_weight_quant_batchmatmul.default"},
    "W4A4_FLATQUANT_DYNAMIC": {"npu.npu_kronecker_quant.default", "npu.npu_quant_matmul.default"},
}


@pytest.mark.parametrize("qtype", sorted(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scheme_linear_in_the_npu_graph(vllm_ctx, monkeypatch, qtype, dtype):
    layer = _layer(qtype, dtype)
    xs = [torch.randn(4, IN, generator=torch.Generator().manual_seed(s)).to(dtype) for s in range(3)]
    with torch.no_grad():
        expected = [layer(x)[0] for x in xs]  # eager, reference kernels
    assert _npu_twins(layer.quant_method.scheme)
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu())
    compiled, graphs = compile_lowered(lambda x: layer(x), dynamic=True)
    with torch.no_grad(), fresh_dynamo_imports():
        for x, exp in zip(xs, expected, strict=True):
            torch._dynamo.mark_static(x)  # the torchair wrapper's NPU strategy: dynamic, every tensor static
            torch.testing.assert_close(compiled(x)[0], exp, atol=0, rtol=0)  # the same kernels' maths
    assert len(graphs) == 1, f"{len(graphs)} compiles over three inputs of one shape"
    assert symbolic_inputs(graphs[0]) == []
    ops = graph_ops(graphs[0])
    assert "aten._local_scalar_dense.default" not in ops and missing_converters(ops) == [], ops
    assert {op for op in ops if op.startswith("npu.")} == SCHEMES[qtype]
