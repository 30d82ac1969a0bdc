# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Quantized MoE checkpoints for the expert-parallel engine modules (TP=2 with expert parallelism).

Under TP=2 a per-token-quantized attention linear (W8A8_DYNAMIC ``o_proj``) quantises each rank's half of its input
with its own per-token scale, which no single-process simulation reproduces; the experts are whole on their rank
under expert parallelism, so they are exact. :func:`quantized_experts_only` therefore quantizes the tiny model and
turns the attention linears back to float, so greedy tokens can be compared with
:mod:`vllm_npu.quant.tools.simulate`.
"""

from __future__ import annotations

import json
from pathlib import Path

from npu_testkit.quant_e2e import QuantCase, quantize


def float_attention(quant_dir: Path, float_dir: Path) -> None:
    """Mark the attention linears FLOAT in the quantized checkpoint, with the float checkpoint's weights."""
    from safetensors.torch import load_file, save_file

    desc_path = quant_dir / "quant_model_description.json"
    desc = json.loads(desc_path.read_text())
    weights_path = quant_dir / "quant_model_weights.safetensors"
    state = load_file(str(weights_path))
    floats = {}
    for f in float_dir.glob("*.safetensors"):
        floats.update(load_file(str(f)))
    for name in [n for n in desc if ".self_attn." in n and desc[n] != "FLOAT"]:
        if name.endswith(".weight"):
            desc[name], state[name] = "FLOAT", floats[name]
        else:  # the weight's scale / offset
            del desc[name]
            state.pop(name, None)
    desc_path.write_text(json.dumps(desc))
    save_file(state, str(weights_path), metadata={"format": "pt"})


def quantized_experts_only(case: QuantCase, out_root: Path) -> tuple[Path, Path]:
    """(float checkpoint, quantized checkpoint with float attention) of ``case`` under ``out_root``."""
    float_dir, quant_dir = quantize(case, out_root)
    float_attention(quant_dir, float_dir)
    return float_dir, quant_dir
