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
- :func:`admit_eplb_quant_method` (around vLLM's ``FusedMoE.__init__``): vLLM 0.11 refuses ``--enable-eplb`` for
  every quant method but its FP8 one while it builds the layer (``NotImplementedError: EPLB is only supported for
  FP8 quantization for now``; its own comment: the other methods differ in nothing essential, what they need is that
  their tensors move). A method declaring ``EplbMovableExperts`` is let past that check, and only that check.
- :func:`check_expert_tensors` (also from ``set_eplb_state``, after the weights are processed): vLLM moves exactly
  the layer's parameters (``FusedMoE.get_expert_weights``, each viewed as ``[local experts, -1]``), so each must
  have the local expert slot first, and no per-expert buffer may sit beside them (it would not move).

Which MoE methods qualify: those declaring npu-interface's ``EplbMovableExperts`` (float experts, and npu-quant's
W8A8_DYNAMIC, W4A8_DYNAMIC and static W8A8 methods, whose processed tensors are all per-expert parameters).
Refused (clear errors): a static map (``npu.expert_map_path``) together with EPLB, and any other MoE method.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm_npu.interface import ConfigError, moves_experts_with_eplb

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


@contextlib.contextmanager
def admit_eplb_quant_method(layer: Any, quant_config: Any, enable_eplb: bool) -> Iterator[None]:
    """Around vLLM's ``FusedMoE.__init__`` of ``layer``: let a quant method that declares npu-interface's
    ``EplbMovableExperts`` past vLLM 0.11's FP8-only EPLB check.

    vLLM's ``__init__`` sets ``layer.enable_eplb``, asks ``quant_config.get_quant_method(layer, prefix)`` and then
    raises unless the method is its FP8 or float one (``fused_moe/layer.py``, ``if self.enable_eplb:`` right after
    ``get_quant_method``; nothing else in ``__init__`` reads the flag after that point). For the duration of the call
    this layer's ``get_quant_method`` call is wrapped on the config instance (an instance attribute shadowing the
    class's method, removed on exit): when the method declares the protocol, ``layer.enable_eplb`` reads False for
    vLLM's check, and it is set back to True when ``__init__`` returns. Any other method meets vLLM's refusal unchanged.
    Without EPLB or a quant config: nothing is touched.
    """
    if not enable_eplb or quant_config is None:
        yield
        return
    shadowed = vars(quant_config).get("get_quant_method")  # an instance's own attribute, kept as it was
    original = quant_config.get_quant_method
    admitted = False

    def get_quant_method(target: Any, prefix: str) -> Any:
        nonlocal admitted
        method = original(target, prefix)
        if target is layer and moves_experts_with_eplb(method):
            target.enable_eplb = False  # vLLM's FP8-only check, next in its __init__, reads it
            admitted = True
        return method

    quant_config.get_quant_method = get_quant_method
    try:
        yield
    finally:
        if shadowed is None:
            del quant_config.get_quant_method  # the class's method again
        else:
            quant_config.get_quant_method = shadowed
        if admitted:
            layer.enable_eplb = True


def check_eplb_layer(layer: Any, *, expert_map_path: str | None) -> None:
    """ConfigError for what dynamic EPLB cannot combine with on this layer."""
    from vllm.model_executor.layers.fused_moe.layer import UnquantizedFusedMoEMethod

    if expert_map_path is not None:
        raise ConfigError(
            f"{layer.layer_name}: npu.expert_map_path (a static placement) cannot be combined with --enable-eplb "
            "(vLLM's EPLB places and moves the experts itself); drop one of the two"
        )
    method = layer.quant_method
    if not isinstance(method, UnquantizedFusedMoEMethod) and not moves_experts_with_eplb(method):
        raise ConfigError(
            f"{layer.layer_name}: --enable-eplb needs a MoE method whose expert tensors vLLM's rearrangement can move "
            "(float experts, or npu-quant's W8A8_DYNAMIC, W4A8_DYNAMIC and W8A8 experts); the layer's is "
            f"{type(method).__name__}. Start without --enable-eplb"
        )


#: Parameters of a FusedMoE layer that vLLM's ``get_expert_weights`` leaves out (not per expert), and buffers that
#: are not per expert.
_NOT_MOVED_PARAMETERS = ("e_score_correction_bias",)
_LAYER_BUFFERS = ("expert_map",)


def check_expert_tensors(layer: Any) -> None:
    """ConfigError unless vLLM's rearrangement moves every per-expert tensor of the built layer and only those.

    vLLM moves the tensors of ``FusedMoE.get_expert_weights()``: every parameter but ``e_score_correction_bias`` and
    the shared experts', viewed as ``[local_num_experts, -1]``. A parameter whose first dimension is not the local
    expert count would be cut into wrong rows (or break the view); a per-expert buffer (a converted copy of a scale,
    say) would stay behind while its expert moves. Both are refused here, naming the tensor, before any step runs.
    """
    local = int(layer.local_num_experts)
    for name, tensor in layer.named_parameters():
        if name in _NOT_MOVED_PARAMETERS or name.startswith("_shared_experts.") or tensor.dim() == 0:
            continue
        if tensor.shape[0] != local or not tensor.is_contiguous():
            raise ConfigError(
                f"{layer.layer_name}: --enable-eplb moves every parameter of the layer expert by expert, but "
                f"{name} {tuple(tensor.shape)} is not a contiguous per-expert tensor of the {local} local experts "
                f"(MoE method {type(layer.quant_method).__name__}). Start without --enable-eplb"
            )
    for name, tensor in layer.named_buffers(recurse=False):
        if name not in _LAYER_BUFFERS and tensor.dim() > 0 and tensor.shape[0] == local:
            raise ConfigError(
                f"{layer.layer_name}: --enable-eplb moves the layer's parameters only, but the per-expert buffer "
                f"{name} {tuple(tensor.shape)} (MoE method {type(layer.quant_method).__name__}) would stay with its "
                "slot when the slot's expert moves. Start without --enable-eplb"
            )


def follow_eplb_state(placement: ExpertPlacement, layer: Any) -> None:
    """Make ``placement`` read the layer's EPLB views (set by vLLM's ``FusedMoE.set_eplb_state``) and count load."""
    table: torch.Tensor | None = layer.logical_to_physical_map
    counts: torch.Tensor | None = layer.logical_replica_count
    load: torch.Tensor | None = layer.expert_load_view
    if table is None or counts is None or load is None:
        raise RuntimeError(f"{layer.layer_name}: set_eplb_state left the EPLB views unset")
    placement.follow(table, counts, load)
