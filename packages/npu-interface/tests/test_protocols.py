# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The capability readers of ``vllm_npu.interface.protocols``: only a declared ``True`` counts, on a class or an
instance, inherited or not; anything else (absent, False, a truthy non-bool) is the safe default."""

from __future__ import annotations

from typing import ClassVar

import pytest
import vllm_npu.interface as interface
from vllm_npu.interface.protocols import fills_output_buffer, moves_experts_with_eplb, runs_layer_moe_plan


class Filler:
    fills_output_buffer: ClassVar[bool] = True
    uses_layer_moe_plan: ClassVar[bool] = True
    moves_with_eplb: ClassVar[bool] = True


class Child(Filler):
    pass


class Opted(Filler):
    fills_output_buffer: ClassVar[bool] = False
    uses_layer_moe_plan: ClassVar[bool] = False
    moves_with_eplb: ClassVar[bool] = False


class Truthy:
    fills_output_buffer = 1  # not the declared bool: refused rather than guessed
    uses_layer_moe_plan = "yes"
    moves_with_eplb = 1


@pytest.mark.parametrize("reader", [fills_output_buffer, runs_layer_moe_plan, moves_experts_with_eplb])
def test_only_a_declared_true_counts(reader) -> None:
    assert reader(Filler) and reader(Filler()) and reader(Child) and reader(Child())
    assert not reader(Opted) and not reader(Opted())
    assert not reader(Truthy) and not reader(object())


def test_the_door_exports_the_contracts() -> None:
    assert interface.fills_output_buffer is fills_output_buffer
    assert interface.runs_layer_moe_plan is runs_layer_moe_plan
    assert interface.moves_experts_with_eplb is moves_experts_with_eplb
    assert {"OutputBufferFiller", "LayerMoEPlanRunner", "EplbMovableExperts"} <= set(interface.__all__)
