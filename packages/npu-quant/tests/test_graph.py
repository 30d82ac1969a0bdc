# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Each scheme's linear forward traced into a compiled decode graph the way the torchair mode compiles it on an NPU.

``torch.compile(fullgraph=True, dynamic=True)`` with every tensor marked static, the scheme's forward kernels swapped
for their NPU twins and ``torch_npu`` replaced by opaque custom ops in the ``npu`` namespace (the real ops' names, so
the lowered graph's node names are the converter table's) with the documented arguments
(:mod:`npu_testkit.fake_torch_npu`). Their bodies are the reference twins, which :mod:`test_schemes` checks against float maths and an independent simulation: what this test
adds is the graph. The compiled forward equals the eager reference over three inputs of one shape, compiles once,
reads nothing on the host, has no symbolic input, and every op of it has an implemented GE converter in torch_npu
2.8.0's bundled torchair (read from the wheel). Load-time kernels (``npu_trans_quant_param``,
``npu_convert_weight_to_int4pack``) run at load, outside the graph, and stay the reference ones here.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from npu_testkit.fake_torch_npu import fake_torch_npu
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
from vllm_npu.quant.tools.quantize_math import (
    flatquant_transforms,
    quantize_w4a4_flatquant,
    quantize_w4a8,
    quantize_w8a8,
    quantize_w8a8_dynamic,
)

IN, OUT, PREFIX = 128, 64, "model.layers.0.mlp.down_proj"


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
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(quant=True))
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
