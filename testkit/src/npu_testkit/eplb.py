# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Dynamic EPLB (vLLM's ``--enable-eplb``) in the engine modules: the engine arguments, and what a worker reads back
after vLLM's ``EplbState`` rearranged its experts (shared by ``test_moe_eplb_dynamic_engine.py``, TP + EP, and
``test_graph_mode_torchair_moe_dp.py``, DP + EP).

:func:`eplb_readback` runs in the worker (``collective_rpc``) and returns plain data (JSON-able, so a DP rank's
script can write it): the physical -> logical maps, this rank's load window, how many rearrangements ran, and every
local slot checked against the checkpoint tensors of the logical expert the map says it holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def eplb_engine_args(num_redundant: int, step_interval: int, window_size: int = 1000) -> dict[str, Any]:
    """``LLM`` keyword arguments for dynamic EPLB. vLLM 0.11's ``EngineArgs`` copies its deprecated EPLB fields
    (defaults 0 / 1000 / 3000, not None) over ``eplb_config`` unless they are None, as the CLI leaves them: they are
    passed as None so that ``eplb_config`` counts."""
    deprecated = ("num_redundant_experts", "eplb_window_size", "eplb_step_interval", "eplb_log_balancedness")
    return {
        "enable_eplb": True,
        "eplb_config": {
            "num_redundant_experts": num_redundant,
            "window_size": window_size,
            "step_interval": step_interval,
        },
        **dict.fromkeys(deprecated),
    }


def initial_map(num_logical: int, num_redundant: int) -> list[int]:
    """vLLM's initial physical -> logical map: the logical experts, then the redundant ones round robin."""
    return list(range(num_logical)) + [e % num_logical for e in range(num_redundant)]


def checkpoint_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, by name."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return weights


def expected_slot(ckpt: dict[str, torch.Tensor], layer: int, e: int, quantized: bool) -> dict[str, torch.Tensor]:
    """The processed tensors of logical expert ``e`` of MoE layer ``layer`` (a Qwen3-MoE checkpoint, float or
    W8A8_DYNAMIC experts): what a slot holding it must hold, by the layer's parameter name."""
    p = f"model.layers.{layer}.mlp.experts.{e}."
    gate_up = torch.cat([ckpt[p + "gate_proj.weight"], ckpt[p + "up_proj.weight"]])
    if not quantized:
        return {"w13_weight": gate_up, "w2_weight": ckpt[p + "down_proj.weight"]}
    scale = torch.cat([ckpt[p + "gate_proj.weight_scale"], ckpt[p + "up_proj.weight_scale"]])
    return {  # npu-quant's W8A8_DYNAMIC processing: int8 weights transposed, per-channel scales flattened
        "w13_weight": gate_up.t(),
        "w2_weight": ckpt[p + "down_proj.weight"].t(),
        "w13_weight_scale": scale.reshape(-1).float(),
        "w2_weight_scale": ckpt[p + "down_proj.weight_scale"].reshape(-1).float(),
    }


def count_rearrangements(worker: Any) -> None:
    """Count the worker's ``EplbState.rearrange`` calls from now on (the profile run's dummy one excluded); read
    by :func:`eplb_readback`. Run through ``collective_rpc`` before generating."""
    state = worker.model_runner.eplb_state
    rearrange = state.rearrange
    state.test_rearrangements = 0

    def counted(model: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("is_profile", False):
            state.test_rearrangements += 1
        return rearrange(model, *args, **kwargs)

    state.rearrange = counted


def eplb_readback(worker: Any) -> dict[str, Any]:
    """This worker's EPLB state after generating: ``physical_to_logical`` (``[layers][physical]``, one state agreed
    by every EP rank), ``load_window`` (this rank's counts summed over the window, ``[layers][physical]``), ``method``
    (the MoE layers' quant method), ``ep_rank``, ``rearrangements`` (-1 unless :func:`count_rearrangements` ran), and
    ``mismatches``: every local slot's tensors compared, exactly, with the checkpoint tensors of the logical expert
    the map places there (vLLM's rearrangement moves each layer parameter; the layer must hold exactly the tensors
    :func:`expected_slot` names). Empty when every slot holds its expert."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    runner = worker.model_runner
    state = runner.eplb_state
    maps = state.physical_to_logical_map.tolist()
    layers = [m for m in runner.get_model().modules() if isinstance(m, FusedMoE)]
    method = type(layers[0].quant_method).__name__
    quantized = method != "AscendUnquantizedFusedMoEMethod"
    ckpt = checkpoint_tensors(runner.model_config.model)
    mismatches = []
    for index, layer in enumerate(layers):
        params = {n: t.detach() for n, t in layer.named_parameters()}
        names = sorted(expected_slot(ckpt, index, 0, quantized))
        if sorted(params) != names:
            mismatches.append(f"layer {index}: parameters {sorted(params)}, expected {names}")
            continue
        per_rank = int(layer.local_num_experts)
        for slot in range(per_rank):
            e = maps[index][layer.ep_rank * per_rank + slot]
            for name, want in expected_slot(ckpt, index, e, quantized).items():
                if not torch.equal(params[name][slot].cpu(), want):
                    mismatches.append(f"layer {index} slot {slot} (logical {e}): {name}")
    return {
        "physical_to_logical": maps,
        "load_window": state.expert_load_window.sum(0).tolist(),
        "method": method,
        "ep_rank": int(layers[0].ep_rank),
        "rearrangements": int(getattr(state, "test_rearrangements", -1)),
        "mismatches": mismatches,
    }
