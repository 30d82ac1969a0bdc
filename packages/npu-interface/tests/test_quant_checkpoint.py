# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The file-level msModelSlim checkpoint contract (shared by the platform and npu-quant)."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_npu.interface.quant_checkpoint import (
    DESCRIPTION_FILENAME,
    expert_quant_types,
    find_description_file,
    is_msmodelslim_quant_config,
    looks_like_description,
    quant_types,
    read_scheme,
    scheme_of,
)


def test_descriptions_are_recognised_and_other_methods_are_not() -> None:
    assert looks_like_description({"model.layers.0.mlp.down_proj.weight": "W8A8"})
    assert not looks_like_description({"model.layers.0.mlp.down_proj.bias": "W8A8"})
    assert not looks_like_description({"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert not looks_like_description(None)
    assert is_msmodelslim_quant_config({"quant_method": "ascend"})
    assert is_msmodelslim_quant_config({"x.weight": "W4A8_DYNAMIC"})
    for other in ({"quant_method": "awq", "bits": 4}, {"quant_method": "compressed-tensors"}, None, "ascend"):
        assert not is_msmodelslim_quant_config(other), other


def test_scheme_names(tmp_path: Path) -> None:
    assert scheme_of({"model_quant_type": "W8A8_DYNAMIC", "a.weight": "W8A8"}) == "W8A8_DYNAMIC"
    assert scheme_of({"a.weight": "W8A8_DYNAMIC", "b.weight": "W8A8", "c.weight": "FLOAT"}) == "W8A8, W8A8_DYNAMIC"
    assert scheme_of({"a.weight": "FLOAT"}) is None
    assert read_scheme(None, {"a.weight": "W4A8_DYNAMIC"}) == "W4A8_DYNAMIC"
    assert read_scheme(tmp_path, {"quant_method": "ascend"}) == "quant_method 'ascend'"  # no file beside it
    assert find_description_file(tmp_path) is None and find_description_file(None) is None
    (tmp_path / DESCRIPTION_FILENAME).write_text(json.dumps({"model_quant_type": "W8A8", "a.weight": "W8A8"}))
    assert find_description_file(tmp_path) == tmp_path / DESCRIPTION_FILENAME
    assert read_scheme(tmp_path, {"quant_method": "ascend"}) == "W8A8"
    (tmp_path / DESCRIPTION_FILENAME).write_text("{not json")
    assert read_scheme(tmp_path) == f"unreadable {DESCRIPTION_FILENAME} (JSONDecodeError)"


def test_expert_quant_types_are_the_routed_experts_only(tmp_path: Path) -> None:
    """DeepSeek-style mixes: static W8A8 attention, W8A8_DYNAMIC routed experts, float shared experts and gate."""
    desc = {
        "model.layers.0.self_attn.o_proj.weight": "W8A8",
        "model.layers.1.mlp.experts.0.gate_proj.weight": "W8A8_DYNAMIC",
        "model.layers.1.mlp.experts.17.down_proj.weight": "W8A8_DYNAMIC",
        "model.layers.1.mlp.shared_experts.down_proj.weight": "W4A8_DYNAMIC",
        "model.layers.1.mlp.gate.weight": "FLOAT",
        "kv_quant_type": "C8",
    }
    assert quant_types(None, desc) == {"W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC", "C8"}
    assert expert_quant_types(None, desc) == {"W8A8_DYNAMIC"}
    assert expert_quant_types(None, {"model.layers.0.mlp.down_proj.weight": "W8A8"}) == frozenset()
    (tmp_path / DESCRIPTION_FILENAME).write_text(json.dumps(desc))
    assert expert_quant_types(tmp_path) == {"W8A8_DYNAMIC"}
    assert expert_quant_types(tmp_path / "none") is None
