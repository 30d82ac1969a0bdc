# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""C8 descriptions (both spellings) and the C8 KV-cache method: scale loading in both tensor spellings, refusals by
name for missing, mis-shaped, non-positive and asymmetric scales, MLA layers and a float cache."""

from __future__ import annotations

import pytest
import torch
from vllm.attention.layer import Attention
from vllm.model_executor.layers.linear import LinearBase
from vllm_npu.interface import ConfigError
from vllm_npu.quant.config import AscendQuantConfig
from vllm_npu.quant.description import QuantDescription, QuantDescriptionError
from vllm_npu.quant.kv_c8 import AscendC8KVCacheMethod

NKV, D = 2, 16
BLOCK = "model.layers.0.self_attn"
ATTN = f"{BLOCK}.attn"

VLLM_ASCEND = {  # what vllm-ascend v0.11.0 reads: kv_quant_type, scales named after its attention parameters
    "kv_quant_type": "C8",
    f"{BLOCK}.q_proj.weight": "W8A8_DYNAMIC",
    f"{BLOCK}.k_proj.weight": "W8A8_DYNAMIC",
    f"{BLOCK}.v_proj.weight": "W8A8_DYNAMIC",
}
MSMODELSLIM = {  # msModelSlim / MindIE "KV Cache int8": kv_cache_type, kv_cache_scale / offset on k_proj / v_proj
    "model_quant_type": "W8A8",
    "kv_cache_type": "C8",
    f"{BLOCK}.q_proj.weight": "FLOAT",
    f"{BLOCK}.k_proj.weight": "FLOAT",
    f"{BLOCK}.k_proj.kv_cache_scale": "W8A8",
    f"{BLOCK}.k_proj.kv_cache_offset": "W8A8",
    f"{BLOCK}.v_proj.weight": "FLOAT",
    f"{BLOCK}.v_proj.kv_cache_scale": "W8A8",
    f"{BLOCK}.v_proj.kv_cache_offset": "W8A8",
}


def _attention(use_mla: bool = False, kv_cache_dtype: str = "int8") -> Attention:
    layer = Attention.__new__(Attention)  # the attributes vLLM's Attention.__init__ sets before get_quant_method
    torch.nn.Module.__init__(layer)
    layer.num_kv_heads, layer.head_size, layer.use_mla, layer.use_sparse = NKV, D, use_mla, False
    layer.kv_cache_dtype = kv_cache_dtype
    return layer


def _qkv() -> LinearBase:
    layer = LinearBase.__new__(LinearBase)
    torch.nn.Module.__init__(layer)
    return layer


def _method(raw: dict, use_mla: bool = False, kv_cache_dtype: str = "int8"):
    config = AscendQuantConfig(QuantDescription.from_mapping(raw))
    qkv = _qkv()
    config._linears[f"{BLOCK}.qkv_proj"] = qkv  # what get_quant_method records for the packed projection
    attn = _attention(use_mla, kv_cache_dtype)
    method = config._c8_method(attn, ATTN)
    method.create_weights(attn)
    return method, attn, qkv


@pytest.mark.parametrize("raw", [VLLM_ASCEND, MSMODELSLIM], ids=["kv_quant_type", "kv_cache_type"])
def test_both_spellings_are_c8(raw: dict) -> None:
    desc = QuantDescription.from_mapping(raw)
    assert desc.kv_c8 and desc.linear_type(f"{BLOCK}.qkv_proj") in ("W8A8_DYNAMIC", "FLOAT")


def test_an_unknown_kv_cache_type_is_refused() -> None:
    with pytest.raises(QuantDescriptionError, match="kv_cache_type='C4' is unknown"):
        QuantDescription.from_mapping({**MSMODELSLIM, "kv_cache_type": "C4"})


def test_get_quant_method_gives_attention_layers_the_c8_method() -> None:
    config = AscendQuantConfig(QuantDescription.from_mapping(VLLM_ASCEND))
    assert isinstance(config.get_quant_method(_attention(), ATTN), AscendC8KVCacheMethod)
    plain = AscendQuantConfig(QuantDescription.from_mapping({f"{BLOCK}.q_proj.weight": "W8A8_DYNAMIC"}))
    assert plain.get_quant_method(_attention(kv_cache_dtype="auto"), ATTN) is None


def test_vllm_ascend_spelling_loads_into_the_attention_layer() -> None:
    method, attn, qkv = _method(VLLM_ASCEND)
    k = torch.linspace(0.01, 0.1, NKV * D, dtype=torch.float16)
    attn.key_antiquant_scale.weight_loader(attn.key_antiquant_scale, k)
    attn.value_antiquant_scale.weight_loader(attn.value_antiquant_scale, k * 2)
    method.process_weights_after_loading(attn)
    assert attn.key_antiquant_scale.dtype == torch.float32 and torch.equal(attn.key_antiquant_scale, k.float())
    assert torch.equal(attn.value_antiquant_scale, (k * 2).float())
    assert not hasattr(attn, "k_scale") and "kv_cache_scale" not in dict(qkv.named_parameters())


def test_msmodelslim_spelling_loads_through_the_packed_projection() -> None:
    method, attn, qkv = _method(MSMODELSLIM)
    params = dict(qkv.named_parameters())  # vLLM's loader renames k_proj / v_proj to qkv_proj, shard "k" / "v"
    k, v = torch.full((NKV * D,), 0.02, dtype=torch.bfloat16), torch.full((NKV * D,), 0.03, dtype=torch.bfloat16)
    params["kv_cache_scale"].weight_loader(params["kv_cache_scale"], k, "k")
    params["kv_cache_scale"].weight_loader(params["kv_cache_scale"], v, "v")
    for shard in "kv":
        params["kv_cache_offset"].weight_loader(params["kv_cache_offset"], torch.zeros(NKV * D), shard)
    method.process_weights_after_loading(attn)
    assert torch.equal(attn.key_antiquant_scale, k.float()) and torch.equal(attn.value_antiquant_scale, v.float())
    assert "kv_cache_scale" not in dict(qkv.named_parameters())  # the holders are dropped after the move


def test_a_description_without_this_layers_scales_is_refused_before_loading() -> None:
    raw = {k: v for k, v in MSMODELSLIM.items() if not k.startswith(f"{BLOCK}.v_proj.kv_cache")}
    with pytest.raises(QuantDescriptionError, match=f"no entry for layer '{ATTN}'.*v_proj.kv_cache_scale"):
        _method(raw)


def test_missing_scales_after_loading_are_refused_by_name() -> None:
    method, attn, _ = _method(VLLM_ASCEND)
    attn.key_antiquant_scale.weight_loader(attn.key_antiquant_scale, torch.ones(NKV * D))
    with pytest.raises(ConfigError, match=f"'{ATTN}' has no value scale"):
        method.process_weights_after_loading(attn)


def test_mis_shaped_scales_are_refused_by_name() -> None:
    _, attn, qkv = _method(MSMODELSLIM)
    with pytest.raises(QuantDescriptionError, match=r"k_proj.kv_cache_scale' has shape \(16,\).*\[32\]"):
        param = dict(qkv.named_parameters())["kv_cache_scale"]
        param.weight_loader(param, torch.ones(D), "k")
    with pytest.raises(QuantDescriptionError, match="key_antiquant_scale"):
        attn.key_antiquant_scale.weight_loader(attn.key_antiquant_scale, torch.ones(3, NKV * D))


@pytest.mark.parametrize("bad", [0.0, -0.5, float("inf")])
def test_non_positive_scales_are_refused_by_name(bad: float) -> None:
    method, attn, _ = _method(VLLM_ASCEND)
    k = torch.ones(NKV * D)
    k[5] = bad
    attn.key_antiquant_scale.weight_loader(attn.key_antiquant_scale, k)
    attn.value_antiquant_scale.weight_loader(attn.value_antiquant_scale, torch.ones(NKV * D))
    with pytest.raises(ConfigError, match=f"{ATTN}.key_antiquant_scale has 1 non-positive or non-finite"):
        method.process_weights_after_loading(attn)


def test_asymmetric_scales_are_refused_by_name() -> None:
    method, attn, qkv = _method(MSMODELSLIM)
    params = dict(qkv.named_parameters())
    for shard in "kv":
        params["kv_cache_scale"].weight_loader(params["kv_cache_scale"], torch.ones(NKV * D), shard)
        params["kv_cache_offset"].weight_loader(params["kv_cache_offset"], torch.full((NKV * D,), 3.0), shard)
    with pytest.raises(ConfigError, match="k_proj.kv_cache_offset is not zero"):
        method.process_weights_after_loading(attn)


def test_mla_layers_and_float_caches_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="MLA attention layer"):
        _method(VLLM_ASCEND, use_mla=True)
    with pytest.raises(ConfigError, match="kv_cache_dtype='auto', not the int8 cache"):
        _method(VLLM_ASCEND, kv_cache_dtype="auto")
