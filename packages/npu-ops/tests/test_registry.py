# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The override table and its registration with vLLM's CustomOp registry."""

from __future__ import annotations

import pytest
from vllm_npu.interface import import_target
from vllm_npu.ops._registry import OOT_OPS, register_oot_ops


def test_table_targets_are_subclasses_of_the_vllm_class(oot_registered) -> None:
    from vllm.model_executor.custom_op import CustomOp

    for name, target in OOT_OPS.items():
        cls = import_target(target)
        assert cls.__mro__[1].__name__ == name or any(c.__name__ == name for c in cls.__mro__[1:]), (name, target)
        assert CustomOp.op_registry_oot[name] is cls
        assert cls.name == name  # register_oot names the override after the vLLM class


def test_registration_is_idempotent(oot_registered) -> None:
    assert register_oot_ops() == []
    assert register_oot_ops() == []


def test_conflicting_override_is_a_clear_error(oot_registered) -> None:
    from vllm.model_executor.custom_op import CustomOp

    name = "NPUOpsTestOnlyOp"

    class Other:
        pass

    CustomOp.op_registry_oot[name] = Other
    try:
        with pytest.raises(RuntimeError, match="already overridden.*Two out-of-tree plugins"):
            register_oot_ops({name: "vllm_npu.ops.activation:NPUSiluAndMul"})
    finally:
        del CustomOp.op_registry_oot[name]


def test_missing_module_is_a_clear_error() -> None:
    with pytest.raises(ModuleNotFoundError, match="'vllm_npu.ops.not_a_module:X': no module named"):
        register_oot_ops({"NPUOpsTestMissing": "vllm_npu.ops.not_a_module:X"})


def test_public_door_is_import_light() -> None:
    from npu_testkit.import_light import assert_import_light

    assert_import_light("import vllm_npu.ops as o", "assert 'RMSNorm' in o.OOT_OPS", forbid=("torch", "vllm"))


def test_component_hooks_resolve() -> None:
    from vllm_npu.interface import resolve_hook
    from vllm_npu.ops._component import COMPONENT

    assert COMPONENT.on_load is not None and callable(resolve_hook(COMPONENT.on_load))


def test_kernels_selected_at_build_are_the_references(vllm_ctx) -> None:
    """On the emulated device every layer holds the reference twin, chosen in __init__ (not per call)."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm_npu.ops import activation, layernorm, rotary_embedding

    assert RMSNorm(8)._add_norm is layernorm.add_rms_norm_reference
    assert SiluAndMul()._kernel is activation.swiglu_reference
    import torch

    assert RotaryEmbedding(8, 8, 16, 10000.0, True, torch.float32)._rotary_mul is rotary_embedding.rotary_mul_reference


def test_ops_layer_spells_its_npu_calls_literally() -> None:
    """The NPU kernels are written as torch_npu.<op>(...) calls, so tests/contract checks them."""
    from pathlib import Path

    from npu_testkit.npu_call_scan import find_npu_calls

    src = Path(__file__).resolve().parents[1] / "src" / "vllm_npu" / "ops"
    names = {c.name for p in src.glob("*.py") for c in find_npu_calls(p.read_text(), str(p))}
    assert {
        "npu_rms_norm",
        "npu_add_rms_norm",
        "npu_gemma_rms_norm",
        "npu_swiglu",
        "npu_fast_gelu",
        "npu_rotary_mul",
        "npu_mrope",
    } <= names
