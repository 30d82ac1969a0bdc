# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Description parsing and tolerant name resolution (pure string logic: no torch, no vLLM)."""

from __future__ import annotations

import pytest
from vllm_npu.quant.description import QuantDescription, QuantDescriptionError, looks_like_description

BASE = {
    "model.embed_tokens.weight": "FLOAT",
    "model.layers.0.self_attn.q_proj.weight": "W8A8",
    "model.layers.0.self_attn.k_proj.weight": "W8A8",
    "model.layers.0.self_attn.v_proj.weight": "W8A8",
    "model.layers.0.self_attn.o_proj.weight": "W8A8_DYNAMIC",
    "model.layers.0.mlp.gate_proj.weight": "W8A8_DYNAMIC",
    "model.layers.0.mlp.up_proj.weight": "FLOAT",
    "model.layers.0.mlp.down_proj.weight": "FLOAT",
    "model.layers.1.mlp.experts.0.gate_proj.weight": "W8A8_DYNAMIC",
    "model.layers.1.mlp.experts.1.down_proj.weight": "W8A8_DYNAMIC",
    "model.layers.2.mlp.experts.0.gate_proj.weight": "W8A8_DYNAMIC",
    "model.layers.2.mlp.experts.1.gate_proj.weight": "FLOAT",
    "model.layers.3.shared_head.head.weight": "W8A8",
    "lm_head.weight": "FLOAT",
    "group_size": 128,
    "version": "1.0.0",
    "model_quant_type": "W8A8",
}


def desc() -> QuantDescription:
    return QuantDescription.from_mapping(dict(BASE))


def test_settings_and_tensors_are_separated() -> None:
    d = desc()
    assert d.group_size == 128 and d.version == "1.0.0" and d.kv_quant_type is None
    assert "group_size" not in d.tensors and d.tensors["model.layers.0.self_attn.q_proj.weight"] == "W8A8"


def test_plain_and_prefixed_names_resolve() -> None:
    d = desc()
    assert d.linear_type("model.layers.0.self_attn.o_proj") == "W8A8_DYNAMIC"
    # vLLM multimodal wrappers and a missing/extra "model." resolve to the checkpoint's names (#1134)
    assert d.linear_type("language_model.model.layers.0.self_attn.o_proj") == "W8A8_DYNAMIC"
    assert d.linear_type("model.language_model.layers.0.self_attn.o_proj") == "W8A8_DYNAMIC"
    assert d.linear_type("layers.0.self_attn.o_proj") == "W8A8_DYNAMIC"
    assert d.linear_type("lm_head") == "FLOAT"


def test_packed_shards_must_agree() -> None:
    d = desc()
    assert d.linear_type("model.layers.0.self_attn.qkv_proj") == "W8A8"
    with pytest.raises(QuantDescriptionError) as err:
        d.linear_type("model.layers.0.mlp.gate_up_proj")
    msg = str(err.value)
    assert "model.layers.0.mlp.gate_up_proj" in msg and "gate_proj.weight=W8A8_DYNAMIC" in msg and "FLOAT" in msg


def test_custom_packed_mapping() -> None:
    d = QuantDescription.from_mapping(
        {"m.layers.0.attn.wq.weight": "W8A8_DYNAMIC", "m.layers.0.attn.wk.weight": "W8A8_DYNAMIC"}
    )
    assert d.linear_type("m.layers.0.attn.wqk", {"wqk": ["wq", "wk"]}) == "W8A8_DYNAMIC"


def test_missing_key_names_layer_lookups_and_nearest() -> None:
    d = desc()
    with pytest.raises(QuantDescriptionError) as err:
        d.linear_type("visual.blocks.0.attn.qkv")  # the FP8 Qwen2.5-VL shape of #4313
    msg = str(err.value)
    assert "'visual.blocks.0.attn.qkv'" in msg and "'visual.blocks.0.attn.qkv.weight'" in msg
    with pytest.raises(QuantDescriptionError) as err:
        d.linear_type("model.layers.0.self_attn.o_prj")
    assert "nearest keys present: model.layers.0.self_attn.o_proj.weight" in str(err.value)


def test_shared_head_is_indexed_without_its_segment() -> None:
    d = desc()
    assert d.linear_type("model.layers.3.head") == "W8A8"
    assert d.linear_type("model.layers.3.shared_head.head") == "W8A8"


def test_experts_must_share_one_type() -> None:
    d = desc()
    assert d.experts_type("model.layers.1.mlp.experts") == "W8A8_DYNAMIC"
    with pytest.raises(QuantDescriptionError, match="mix quant types"):
        d.experts_type("model.layers.2.mlp.experts")
    with pytest.raises(QuantDescriptionError, match="model.layers.9.mlp.experts"):
        d.experts_type("model.layers.9.mlp.experts")


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ({"a.weight": "W2A2"}, "unknown quant type"),
        ({"group_size": 64}, "no tensor entries"),
        ({"a.weight": "W8A8", "version": "2.0"}, "version"),
        ({"a.weight": "W8A8", "group_size": -1}, "group_size"),
    ],
)
def test_bad_descriptions_are_rejected(raw: dict, fragment: str) -> None:
    with pytest.raises(QuantDescriptionError, match=fragment):
        QuantDescription.from_mapping(raw)


def test_looks_like_description_recognises_only_modelslim() -> None:
    assert looks_like_description(BASE)
    assert not looks_like_description({"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert not looks_like_description({"quant_method": "gptq", "bits": 4, "group_size": 128})
    assert not looks_like_description(None)
