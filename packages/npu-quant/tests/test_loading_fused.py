# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Loading the shards of a fused layer (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``): every mis-shaped
checkpoint tensor of every scheme is a QuantLoadError naming the tensor, its shape and the expected one (vLLM's
merged loaders used to fail with a bare ``RuntimeError: start (0) + length (64) exceeds dimension size (32)``), and
correct shards still load and process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from vllm_npu.quant.config import AscendQuantConfig
from vllm_npu.quant.description import QuantDescription
from vllm_npu.quant.params import QuantLoadError
from vllm_npu.quant.tools.quantize_math import (
    flatquant_transforms,
    quantize_w4a4_flatquant,
    quantize_w4a8,
    quantize_w8a8,
    quantize_w8a8_dynamic,
)

ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"
K = 64  # hidden size: the input of both fused layers
LEFT, RIGHT = flatquant_transforms(K, seed=3)

#: scheme -> (description settings, quantizer of one shard's float weight [n, K])
SCHEMES: dict[str, tuple[dict[str, Any], Callable[[torch.Tensor], dict[str, torch.Tensor]]]] = {
    "W8A8": ({}, lambda w: quantize_w8a8(w, None, -1.0, 1.0, torch.float32)),
    "W8A8_DYNAMIC": ({}, lambda w: quantize_w8a8_dynamic(w, torch.float32)),
    "W4A8_DYNAMIC": ({"group_size": 32}, lambda w: quantize_w4a8(w, 32, "0", False, torch.float32)),
    "W4A8_DYNAMIC-1.0.0": (
        {"group_size": 32, "version": "1.0.0"},
        lambda w: quantize_w4a8(w, 32, "1.0.0", False, torch.float32),
    ),
    "W4A4_FLATQUANT_DYNAMIC": ({}, lambda w: quantize_w4a4_flatquant(w, LEFT, RIGHT, 0.9, torch.float32)),
}

#: layer kind -> (fused prefix, checkpoint shard names, shard ids, output rows per shard)
LAYERS = {
    "qkv": (f"{ATTN}.qkv_proj", ["q_proj", "k_proj", "v_proj"], ["q", "k", "v"], [64, 32, 32]),
    "gate_up": (f"{MLP}.gate_up_proj", ["gate_proj", "up_proj"], [0, 1], [48, 48]),
}


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


def _shards(scheme: str, kind: str) -> list[dict[str, torch.Tensor]]:
    quantize = SCHEMES[scheme][1]
    gen = torch.Generator().manual_seed(0)
    return [quantize(torch.randn(n, K, generator=gen) * 0.2) for n in LAYERS[kind][3]]


def _layer(scheme: str, kind: str, names: list[str]) -> Any:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    prefix, ckpt, _, rows = LAYERS[kind]
    base = prefix.rsplit(".", 1)[0]
    qtype = scheme.split("-")[0]
    entries: dict[str, Any] = {f"{base}.{c}.{n}": qtype for c in ckpt for n in names}
    entries.update(SCHEMES[scheme][0])
    cfg = AscendQuantConfig(QuantDescription.from_mapping(entries))
    if kind == "qkv":
        return QKVParallelLinear(K, 16, 4, 2, bias=False, quant_config=cfg, prefix=prefix)
    return MergedColumnParallelLinear(K, rows, bias=False, quant_config=cfg, prefix=prefix)


def _mis_shaped(t: torch.Tensor) -> torch.Tensor:
    """A tensor of another shape: half the rows, or one more element for a per-tensor value."""
    if t.numel() == 1:
        return torch.cat([t.reshape(1), t.reshape(1)])
    if t.dim() == 2 and t.shape[0] == t.shape[1]:  # FlatQuant's square transforms
        return torch.zeros(t.shape[0] + 1, t.shape[1] + 1, dtype=t.dtype)
    return t[: max(1, t.shape[0] // 2)].clone()


CASES = [
    (scheme, kind, name)
    for scheme in SCHEMES
    for kind in LAYERS
    for name in _shards(scheme, kind)[0]  # every tensor a shard of that scheme has on disk
]


@pytest.mark.parametrize(("scheme", "kind", "name"), CASES, ids=[f"{s}-{k}-{n}" for s, k, n in CASES])
def test_mis_shaped_shard_tensor_names_tensor_and_shapes(vllm_ctx: object, scheme, kind, name) -> None:
    good = _shards(scheme, kind)
    layer = _layer(scheme, kind, list(good[0]))
    prefix, _, ids, _ = LAYERS[kind]
    shard = 1  # the second shard: k of q/k/v, up of gate/up
    bad = _mis_shaped(good[shard][name])
    params = dict(layer.named_parameters())
    with pytest.raises(QuantLoadError) as err:
        params[name].weight_loader(params[name], bad, ids[shard])
    msg = str(err.value)
    assert f"'{prefix}.{name}'" in msg and f"shard {ids[shard]!r}" in msg, msg
    assert str(tuple(bad.shape)) in msg and str(tuple(good[shard][name].shape)) in msg, msg


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_correct_shards_load_and_process(vllm_ctx: object, scheme, kind) -> None:
    good = _shards(scheme, kind)
    layer = _layer(scheme, kind, list(good[0]))
    params = dict(layer.named_parameters())
    for shard_id, tensors in zip(LAYERS[kind][2], good):
        for name, t in tensors.items():
            params[name].weight_loader(params[name], t, shard_id)
    layer.quant_method.process_weights_after_loading(layer)


def test_scalar_per_tensor_value_is_accepted_where_vllm_takes_it(vllm_ctx: object) -> None:
    # A 0-dimensional per-tensor scale: vLLM's unfused loaders reshape it to [1], so the shape check lets it through.
    from vllm.model_executor.layers.linear import RowParallelLinear

    prefix = f"{ATTN}.o_proj"
    t = quantize_w8a8(torch.randn(32, K) * 0.2, None, -1.0, 1.0, torch.float32)
    cfg = AscendQuantConfig(QuantDescription.from_mapping({f"{prefix}.{n}": "W8A8" for n in t}))
    layer = RowParallelLinear(K, 32, bias=False, quant_config=cfg, prefix=prefix)
    params = dict(layer.named_parameters())
    for name, value in t.items():
        value = value.reshape(()) if name in ("input_scale", "input_offset") else value
        params[name].weight_loader(params[name], value)
    layer.quant_method.process_weights_after_loading(layer)


def test_mis_shaped_scale_in_unfused_layer_still_names_it(vllm_ctx: object) -> None:
    from vllm.model_executor.layers.linear import RowParallelLinear

    prefix = f"{ATTN}.o_proj"
    t = quantize_w8a8(torch.randn(32, K) * 0.2, None, -1.0, 1.0, torch.float32)
    cfg = AscendQuantConfig(QuantDescription.from_mapping({f"{prefix}.{n}": "W8A8" for n in t}))
    layer = RowParallelLinear(K, 32, bias=False, quant_config=cfg, prefix=prefix)
    params = dict(layer.named_parameters())
    for name in ("input_scale", "deq_scale"):
        with pytest.raises(QuantLoadError) as err:
            params[name].weight_loader(params[name], _mis_shaped(t[name]))
        assert f"'{prefix}.{name}'" in str(err.value) and str(tuple(_mis_shaped(t[name]).shape)) in str(err.value)
