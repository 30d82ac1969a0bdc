# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""The MoE forward as one function over pluggable parts: gate -> dispatch -> experts -> combine.

:func:`build_moe_plan` chooses every kernel once (when a layer is built); :func:`moe_forward` runs a plan::

    out = moe_forward(hidden [T, H], router_logits [T, E], plan=plan, experts=experts_fn,
                      e_score_correction_bias=bias_or_None)            # -> [T, H], hidden.dtype

``experts_fn(rows [N, H], group_counts [E_local] int64) -> [N, H]`` computes the expert MLPs over rows sorted by
local expert (``group_counts`` rows per expert, in order). ``plan.unquantized_experts(w13, w2)`` is the float one;
a quantised MoE method passes its own (quantise rows, int8 grouped matmuls, dequant/swiglu, ...) and keeps the
gating, token permutation and expert-parallel communication of the plan unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm_npu.interface import ConfigError, KernelBackend

from .comm import AllToAll, AllToAllDispatcher, LocalDispatcher
from .experts import GROUPED_MATMUL, ExpertsFn, GroupedMatmul, UnquantizedExperts, build_activation
from .gathered import GatheredDispatcher
from .gating import Gate, RoutingConfig, build_gate, gate_path
from .mc2 import MC2Comm, MC2Dispatcher, StepDispatcher, build_mc2
from .placement import ExpertPlacement
from .routing import build_graph_unpermute, build_unpermute, init_routing_kernel

Dispatcher = LocalDispatcher | AllToAllDispatcher | GatheredDispatcher | MC2Dispatcher | StepDispatcher


@dataclass(frozen=True, eq=False)
class MoEPlan:
    """Everything a MoE layer decided at build time. Immutable; one per layer."""

    routing: RoutingConfig
    num_experts: int
    gate: Gate
    gate_path: str
    dispatcher: Dispatcher
    grouped_matmul: GroupedMatmul
    activation: Callable[[torch.Tensor], torch.Tensor]
    apply_router_weight_on_input: bool = False

    def unquantized_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> UnquantizedExperts:
        """The float expert MLP over vLLM-layout weights (w13 [E_local, 2I, H], w2 [E_local, H, I])."""
        return UnquantizedExperts(w13, w2, self.grouped_matmul, self.activation)

    @property
    def all_to_all(self) -> bool:
        """The result is complete on every rank (tokens were exchanged), not a partial sum to all-reduce."""
        d = self.dispatcher
        if isinstance(d, StepDispatcher):
            d = d.mc2
        return isinstance(d, (AllToAllDispatcher, GatheredDispatcher)) or (
            isinstance(d, MC2Dispatcher) and not d.replicated_tokens
        )

    @property
    def host_sized(self) -> bool:
        """Whether a dispatcher of the plan sizes its messages on the host (the all-to-all's split sizes): such a
        plan cannot run inside a compiled graph."""
        d = self.dispatcher
        return any(
            isinstance(x, AllToAllDispatcher) for x in ((d.mc2, d.other) if isinstance(d, StepDispatcher) else (d,))
        )

    @property
    def mc2(self) -> MC2Dispatcher | None:
        """The MC2 dispatcher of the plan, if it has one."""
        d = self.dispatcher
        return d.mc2 if isinstance(d, StepDispatcher) else d if isinstance(d, MC2Dispatcher) else None


def build_moe_plan(
    routing: RoutingConfig,
    num_experts: int,
    *,
    act_dtype: torch.dtype,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
    all_to_all: AllToAll | None = None,
    ep_rank: int = 0,
    expert_maps: Sequence[torch.Tensor] | None = None,
    apply_router_weight_on_input: bool = False,
    placement: ExpertPlacement | None = None,
    mc2: MC2Comm | None = None,
    mc2_capacity: int = 0,
    step_tokens: Callable[[torch.Tensor], int] | None = None,
    gather_group: Any | None = None,
    backend: KernelBackend | None = None,
) -> MoEPlan:
    """Choose the kernels and the dispatcher for one MoE layer.

    - ``expert_map`` (this rank's [E] global -> local map, -1 elsewhere) without ``all_to_all``: experts split
      over ranks that hold the same tokens; the output is this rank's partial sum (reduce it across the EP group).
    - ``all_to_all`` with ``expert_maps`` (every rank's map) and ``ep_rank``: tokens differ per rank and are
      exchanged; the output is complete.
    - ``placement`` (with ``ep_rank``) replaces the expert maps: any placement, redundant replicas included.
    - ``mc2`` (the group of the MC2 kernels): MC2 for steps of up to ``mc2_capacity`` tokens (``step_tokens``
      counts a step; default: the rows of this rank), the dispatcher above beyond. With ``all_to_all`` tokens differ
      per rank; without, every rank holds the same tokens and MC2 splits them (the output stays a partial sum).
    - ``gather_group`` (a process group) instead of ``all_to_all``: tokens differ per rank, every rank holds the same
      number of them, and they are exchanged by all-gather and reduce-scatter over that group
      (:class:`~.gathered.GatheredDispatcher`: no size read on the host); the output is complete.
    """
    if apply_router_weight_on_input and routing.top_k != 1:
        raise ConfigError("apply_router_weight_on_input needs top_k == 1 (as in vLLM)")
    init_routing = init_routing_kernel().select(backend)  # the chip's pair (310P: torch ops)
    unpermute = build_unpermute(act_dtype, backend)
    dispatcher: Dispatcher
    if gather_group is not None:
        if all_to_all is not None:
            raise ConfigError("give the all-to-all exchange or the gather group, not both")
        where = placement or (ExpertPlacement.from_expert_maps(expert_maps) if expert_maps else None)
        if where is None:
            raise ConfigError("the gathered dispatcher needs the placement of the experts (placement or expert_maps)")
        local = LocalDispatcher(num_experts, init_routing, unpermute, placement=where, rank=ep_rank)
        dispatcher = GatheredDispatcher(local, gather_group, where.world)
    elif all_to_all is not None:
        if expert_maps is None and placement is None:
            raise ConfigError("the all-to-all dispatcher needs the expert maps of every rank (expert_maps)")
        dispatcher = AllToAllDispatcher(
            num_experts, ep_rank, expert_maps or (), all_to_all, init_routing, unpermute, placement
        )
    elif placement is not None:
        dispatcher = LocalDispatcher(num_experts, init_routing, unpermute, placement=placement, rank=ep_rank)
    else:
        dispatcher = LocalDispatcher(
            num_experts, init_routing, unpermute, expert_map, graph_unpermute=build_graph_unpermute(backend)
        )
    if mc2 is not None:
        if mc2_capacity <= 0:
            raise ConfigError("MC2 needs a positive token capacity (mc2_capacity)")
        where = placement or (ExpertPlacement.from_expert_maps(expert_maps) if expert_maps else None)
        if where is None and mc2.world == 1:
            where = ExpertPlacement(num_experts, [list(range(num_experts))])
        if where is None:
            raise ConfigError("MC2 needs the placement of the experts (placement or expert_maps)")
        steps = step_tokens or (lambda hidden: int(hidden.shape[0]))
        dispatcher = StepDispatcher(
            build_mc2(
                where,
                mc2,
                capacity=mc2_capacity,
                replicated_tokens=all_to_all is None and gather_group is None,
                backend=backend,
            ),
            dispatcher,
            mc2_capacity,
            steps,
        )
    return MoEPlan(
        routing=routing,
        num_experts=num_experts,
        gate=build_gate(routing, num_experts, backend),
        gate_path=gate_path(routing, num_experts),
        dispatcher=dispatcher,
        grouped_matmul=GROUPED_MATMUL.select(backend),
        activation=build_activation(activation, backend),
        apply_router_weight_on_input=apply_router_weight_on_input,
    )


def moe_forward(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    *,
    plan: MoEPlan,
    experts: ExpertsFn,
    e_score_correction_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed-expert output for ``hidden_states`` [T, H] (no shared experts, no reduction across ranks)."""
    if hidden_states.dim() != 2 or router_logits.shape != (hidden_states.shape[0], plan.num_experts):
        raise ValueError(
            f"moe_forward wants hidden [T, H] and router_logits [T, {plan.num_experts}]; got "
            f"{tuple(hidden_states.shape)} and {tuple(router_logits.shape)}"
        )
    topk_weights, topk_ids = plan.gate(hidden_states, router_logits, e_score_correction_bias)
    if plan.apply_router_weight_on_input:
        hidden_states = hidden_states * topk_weights.to(hidden_states.dtype)
        topk_weights = torch.ones_like(topk_weights)
    if hidden_states.shape[0] == 0 and not plan.all_to_all:
        return torch.zeros_like(hidden_states)
    return plan.dispatcher(hidden_states, topk_weights, topk_ids, experts)
