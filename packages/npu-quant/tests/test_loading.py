# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Loading a quantized layer rejects wrong dtypes, wrong shapes, missing tensors and inconsistent values, with an
error that names the tensor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm_npu.quant.config import AscendQuantConfig
from vllm_npu.quant.description import QuantDescription
from vllm_npu.quant.params import QuantLoadError
from vllm_npu.quant.tools.quantize_math import quantize_w8a8, quantize_w8a8_dynamic

O_PROJ = "model.layers.0.self_attn.o_proj"


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def row_layer(qtype: str, suffixes: list[str], **settings: Any) -> Any:
    from vllm.model_executor.layers.linear import RowParallelLinear

    entries: dict[str, Any] = {f"{O_PROJ}.{s}": qtype for s in suffixes}
    entries.update(settings)
    cfg = AscendQuantConfig(QuantDescription.from_mapping(entries))
    return RowParallelLinear(64, 32, bias=False, quant_config=cfg, prefix=O_PROJ)


def feed(layer: Any, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(layer.named_parameters())
    for k, t in tensors.items():
        params[k].weight_loader(params[k], t)


def good() -> dict[str, torch.Tensor]:
    return quantize_w8a8_dynamic(torch.randn(32, 64) * 0.2, torch.float32)


def test_group_size_not_dividing_k_is_rejected_at_build(vllm_ctx: object) -> None:
    with pytest.raises(QuantLoadError, match=rf"{O_PROJ}: input size 64 .* group_size 256"):
        row_layer("W4A8_DYNAMIC", ["weight"])


def test_float_weight_in_int8_slot_is_rejected(vllm_ctx: object) -> None:
    t = good()
    layer = row_layer("W8A8_DYNAMIC", list(t))
    with pytest.raises(QuantLoadError) as err:
        feed(layer, {"weight": torch.randn(32, 64)})
    assert f"'{O_PROJ}.weight'" in str(err.value) and "float32" in str(err.value) and "int8" in str(err.value)


def test_wrong_shape_names_tensor_and_shapes(vllm_ctx: object) -> None:
    t = good()
    layer = row_layer("W8A8_DYNAMIC", list(t))
    with pytest.raises(QuantLoadError) as err:
        feed(layer, {"weight_scale": torch.rand(16, 1)})
    msg = str(err.value)
    assert f"'{O_PROJ}.weight_scale'" in msg and "(16, 1)" in msg and "(32, 1)" in msg


def test_missing_tensor_is_named_after_loading(vllm_ctx: object) -> None:
    t = good()
    layer = row_layer("W8A8_DYNAMIC", list(t))
    feed(layer, {"weight": t["weight"]})  # no weight_scale in the checkpoint
    with pytest.raises(QuantLoadError, match=rf"{O_PROJ}\.weight_scale"):
        layer.quant_method.process_weights_after_loading(layer)


def test_optional_offset_must_be_zero(vllm_ctx: object) -> None:
    t = good()
    t["weight_offset"] = torch.ones(32, 1)
    layer = row_layer("W8A8_DYNAMIC", list(t))
    feed(layer, t)
    with pytest.raises(QuantLoadError, match="weight_offset has non-zero values"):
        layer.quant_method.process_weights_after_loading(layer)


def test_fractional_zero_point_is_rejected(vllm_ctx: object) -> None:
    t = quantize_w8a8(torch.randn(32, 64) * 0.2, None, -2.0, 3.0, torch.float32)
    layer = row_layer("W8A8", list(t))
    with pytest.raises(QuantLoadError, match="input_offset.*integers"):
        feed(layer, {"input_offset": torch.tensor([0.5])})


def test_qkv_shards_must_share_their_activation_scale(vllm_ctx: object) -> None:
    from vllm.model_executor.layers.linear import QKVParallelLinear

    prefix = "model.layers.0.self_attn"
    shards = {
        s: quantize_w8a8(torch.randn(n, 64) * 0.2, None, -1.0 * (1 + (s == "v")), 1.0, torch.float32)
        for s, n in (("q", 64), ("k", 32), ("v", 32))
    }
    entries = {f"{prefix}.{s}_proj.{k}": "W8A8" for s, t in shards.items() for k in t}
    cfg = AscendQuantConfig(QuantDescription.from_mapping(entries))
    layer = QKVParallelLinear(64, 16, 4, 2, bias=False, quant_config=cfg, prefix=f"{prefix}.qkv_proj")
    params = dict(layer.named_parameters())
    with pytest.raises(QuantLoadError) as err:
        for s, t in shards.items():
            for k, v in t.items():
                params[k].weight_loader(params[k], v, s)
    assert "qkv_proj.input_scale" in str(err.value) and "'v'" in str(err.value)


def test_int4_values_out_of_range_are_rejected(vllm_ctx: object) -> None:
    from vllm_npu.quant.tools.quantize_math import quantize_w4a8

    t = quantize_w4a8(torch.randn(32, 64) * 0.2, 32, "0", True, torch.float32)
    t["weight"] = t["weight"].clone()
    t["weight"][0, 0] = 12
    layer = row_layer("W4A8_DYNAMIC", list(t), group_size=32)
    feed(layer, {k: v for k, v in t.items()})
    with pytest.raises(QuantLoadError, match=r"o_proj\.weight \(int4 values\) must hold values in \[-8, 7\]"):
        layer.quant_method.process_weights_after_loading(layer)
