# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The quantizer's static W8A8 expert calibration (:func:`vllm_npu.quant.tools.quantizer._expert_ranges`): gate/up of one
expert share one range (the MoE kernel quantizes their common input once), and an expert no calibration token was
routed to takes the union of the same projection over its layer's calibrated experts."""

from __future__ import annotations

import pytest
from vllm_npu.quant.tools.quantizer import QuantizeError, _expert_ranges

L0, L1 = "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"


def test_gate_and_up_share_the_union_and_unreached_experts_take_the_layer_union() -> None:
    names = [f"{layer}.{e}.{p}" for layer in (L0, L1) for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
    stats = {
        f"{L0}.0.gate_proj": (-1.0, 2.0),
        f"{L0}.0.up_proj": (-1.5, 1.0),
        f"{L0}.0.down_proj": (-0.5, 0.5),
        f"{L0}.1.gate_proj": (-3.0, 1.0),
        f"{L0}.1.up_proj": (-3.0, 1.0),
        f"{L0}.1.down_proj": (-0.2, 0.9),
        **{
            f"{L1}.{e}.{p}": (-float(e + 1), float(e + 1))
            for e in range(3)
            for p in ("gate_proj", "up_proj", "down_proj")
        },
    }
    out = _expert_ranges(names, stats)
    assert out[f"{L0}.0.gate_proj"] == out[f"{L0}.0.up_proj"] == (-1.5, 2.0)
    assert out[f"{L0}.2.gate_proj"] == out[f"{L0}.2.up_proj"] == (-3.0, 2.0)  # expert 2 unreached: layer union
    assert out[f"{L0}.2.down_proj"] == (-0.5, 0.9)
    assert out[f"{L1}.2.down_proj"] == (-3.0, 3.0)  # reached experts keep their own range
    assert set(out) == set(names)


def test_a_layer_no_calibration_token_reached_is_an_error() -> None:
    with pytest.raises(
        QuantizeError, match=r"calibration reached no expert of 'model\.layers\.1\.mlp\.experts\.\*\.down_proj'"
    ):
        _expert_ranges([f"{L0}.0.down_proj", f"{L1}.0.down_proj"], {f"{L0}.0.down_proj": (-1.0, 1.0)})
