# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""Dynamic EPLB (vLLM's ``--enable-eplb`` / ``eplb_config``) for npu-ops' MoE layers.

vLLM's ``EplbState`` (``vllm/distributed/eplb/``) owns the state and the rearrangement: per MoE layer a physical ->
logical map, a logical -> physical replica table ``[E, 1024]`` (-1 padded), the replica counts ``[E]`` and the
per-pass load ``[num_physical]`` int32; every ``step_interval`` steps it sums the load window over the EP group,
runs its rebalancing algorithm and exchanges expert weights rank to rank (``batch_isend_irecv`` on the EP device
group: gloo on the emulated device, HCCL on the NPU). The model gives it each layer's views through
``FusedMoE.set_eplb_state``. What npu-ops adds:

- :func:`eplb_placement`: the layer's :class:`~.placement.ExpertPlacement` at build time, the one vLLM starts from
  (``EplbState.build_initial_global_physical_to_logical_map``: logical experts then redundant ones, split evenly
  rank by rank, the same map vLLM's weight loading uses), so every dispatcher (local, all-to-all, MC2) routes to
  physical slots from the first step.
- :func:`follow_eplb_state` (called from the layer's ``set_eplb_state``): the placement reads vLLM's replica
  tables in place from then on and counts the rows each dispatcher routes into the load view, on the device with
  no host sync (see :mod:`.comm` for what each dispatcher counts).

The CUDA-only calls of vLLM's rearrangement (``torch.cuda.synchronize``) go to the device backend in npu-platform's
model runner; vLLM's config check that refuses EPLB outside CUDA is npu-patches' ``eplb-platform-check``.
Refused (clear errors): a static map (``npu.expert_map_path``) together with EPLB, and any MoE method but the
float one (npu-quant's methods refuse EPLB when they are built).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm_npu.interface import ConfigError

from .placement import ExpertPlacement


def eplb_placement(num_logical: int, num_redundant: int, ep_size: int, *, layer_name: str = "") -> ExpertPlacement:
    """vLLM's initial EPLB placement of ``num_logical + num_redundant`` physical experts over ``ep_size`` ranks."""
    from vllm.distributed.eplb.eplb_state import EplbState

    physical = list(EplbState.build_initial_global_physical_to_logical_map(num_logical, num_redundant))
    if len(physical) % ep_size:
        raise ConfigError(
            f"{layer_name}: dynamic EPLB needs the {len(physical)} physical experts ({num_logical} + "
            f"eplb_config.num_redundant_experts={num_redundant}) split evenly over {ep_size} expert-parallel ranks; "
            "choose num_redundant_experts so that the sum is a multiple of the EP size"
        )
    per_rank = len(physical) // ep_size
    slots = [physical[r * per_rank : (r + 1) * per_rank] for r in range(ep_size)]
    return ExpertPlacement(num_logical, slots, one_per_rank=False)


def eplb_tables(
    physical_to_logical: list[int], num_logical: int, width: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """``EplbState``'s tables of one layer for a physical -> logical map: the logical -> physical replica table
    ``[num_logical, width]`` int64 (replicas in physical order, -1 padded; vLLM's width is 1024) and the replica
    counts ``[num_logical]`` int64. For tests and benchmarks that stand in for vLLM's state."""
    table = torch.full((num_logical, width), -1, dtype=torch.long)
    counts = torch.zeros(num_logical, dtype=torch.long)
    for p, e in enumerate(physical_to_logical):
        table[e, counts[e]] = p
        counts[e] += 1
    return table, counts


def check_eplb_layer(layer: Any, *, expert_map_path: str | None) -> None:
    """ConfigError for what dynamic EPLB cannot combine with on this layer."""
    from vllm.model_executor.layers.fused_moe.layer import UnquantizedFusedMoEMethod

    if expert_map_path is not None:
        raise ConfigError(
            f"{layer.layer_name}: npu.expert_map_path (a static placement) cannot be combined with --enable-eplb "
            "(vLLM's EPLB places and moves the experts itself); drop one of the two"
        )
    if not isinstance(layer.quant_method, UnquantizedFusedMoEMethod):
        raise ConfigError(
            f"{layer.layer_name}: --enable-eplb supports float experts only; the layer's MoE method is "
            f"{type(layer.quant_method).__name__}. Start without --enable-eplb"
        )


def follow_eplb_state(placement: ExpertPlacement, layer: Any) -> None:
    """Make ``placement`` read the layer's EPLB views (set by vLLM's ``FusedMoE.set_eplb_state``) and count load."""
    table: torch.Tensor | None = layer.logical_to_physical_map
    counts: torch.Tensor | None = layer.logical_replica_count
    load: torch.Tensor | None = layer.expert_load_view
    if table is None or counts is None or load is None:
        raise RuntimeError(f"{layer.layer_name}: set_eplb_state left the EPLB views unset")
    placement.follow(table, counts, load)
