# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""AscendFusedMoE / AscendSharedFusedMoE: vLLM's FusedMoE layers with npu-ops' MoE forward.

Registered (by name, through ``vllm_npu.ops._registry``) for vLLM's ``FusedMoE`` and ``SharedFusedMoE``, so every
model that builds those gets these classes. What changes against vLLM:

- At build, the layer chooses its kernels and token dispatcher once: ``layer.moe_plan`` (:class:`MoEPlan`).
- An unquantised layer gets :class:`AscendUnquantizedFusedMoEMethod`, whose ``apply`` is :func:`moe_forward` over
  vLLM-layout float weights. Quantised methods (npu-quant) call :func:`moe_forward` with ``layer.moe_plan`` and
  their own experts function: the quant-method seam of vLLM (``layer.quant_method.apply``) is kept. A method
  declares npu-interface's :class:`~vllm_npu.interface.protocols.LayerMoEPlanRunner` (class attribute
  ``uses_layer_moe_plan = True``) to say it runs ``layer.moe_plan``; only then may the layer use the all-to-all
  mode below. The contract is the interface's because npu-ops reads it and must not know which wheel declares it.
- Expert parallelism: with replicated tokens (vLLM's default EP, data parallel size 1) each rank runs its experts
  and vLLM's usual all-reduce sums the ranks. With data-parallel attention (DP > 1) rows cross the DP ranks in
  ``forward_impl`` (vLLM's own DP dispatch/combine is a no-op on our device communicator): by all-to-all through
  the EP group's device communicator when attention TP is 1 and the quant method runs ``layer.moe_plan``, else by
  all-gather over the DP group, local experts, reduce-scatter back, then vLLM's TP all-reduce. With graphs on
  (torchair, PIECEWISE, FULL_DECODE_ONLY: no ``--enforce-eager``) vLLM pads every DP rank to the same size, so the
  all-to-all becomes the gathered dispatcher (:mod:`.gathered`) and the DP gather takes static shapes: no size is
  read on the host, and the layer can run inside a captured or compiled graph (:mod:`.capture`).

- ``npu.expert_map_path``: a static placement (:mod:`.placement`, redundant replicas allowed) replaces vLLM's;
  the layer then holds that rank's slots (its weights are re-created at their count) and every dispatcher maps
  routed experts to replicas.
- ``--enable-eplb`` (vLLM's dynamic EPLB, :mod:`.eplb`): the layer starts from vLLM's initial placement of the
  physical experts, follows vLLM's ``EplbState`` tables in place (``set_eplb_state``) and counts the expert load in
  every dispatcher; vLLM's rearrangement moves the weights (every parameter of the layer: quantized experts' scales
  and biases too, for quant methods declaring npu-interface's ``EplbMovableExperts``).
- ``npu.moe_mc2``: MC2 (:mod:`.mc2`) for steps up to its token capacity, chosen per step (rule in
  :func:`~.mc2.mc2_candidate`); the dispatcher above beyond.
- ``npu.multistream_overlap_shared_expert``: shared experts on a side stream while the routed ones run
  (:mod:`.overlap`).

Everything else (weight loading, the ``torch.ops.vllm.moe_forward`` custom op, the final all-reduce) is vLLM's.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.model_executor.layers.fused_moe.layer import FusedMoE, UnquantizedFusedMoEMethod, determine_expert_map
from vllm_npu.interface import (
    AdditionalConfig,
    ConfigError,
    DeviceMode,
    current_mode,
    get_logger,
    is_310p,
    kernel_backend,
    runs_layer_moe_plan,
    traces_moe_in_graph,
)

from .capture import host_ints
from .comm import AllToAll, coordinator_all_to_all
from .eplb import (
    admit_eplb_quant_method,
    check_eplb_layer,
    check_expert_tensors,
    eplb_placement,
    follow_eplb_state,
)
from .forward import MoEPlan, build_moe_plan, moe_forward
from .gathered import all_gather_rows, dp_padded_rows, pad_rows, reduce_scatter_rows
from .gating import RoutingConfig
from .mc2 import MC2Comm, mc2_candidate, mc2_tokens_capacity
from .overlap import SideStream, device_stream_api, graph_overlap
from .placement import ExpertPlacement, layer_index, load_expert_map

if TYPE_CHECKING:
    from vllm.model_executor.layers.shared_fused_moe.shared_fused_moe import SharedFusedMoE
else:
    from vllm_npu.interface import import_moved

    # vLLM 0.11.1 moved it into the fused_moe package (the type checker sees 0.11.0's location).
    SharedFusedMoE = import_moved(
        "SharedFusedMoE",
        "vllm.model_executor.layers.fused_moe.shared_fused_moe",
        "vllm.model_executor.layers.shared_fused_moe.shared_fused_moe",
    )

logger = get_logger(__name__)
_LOGGED_REFUSALS: set[str] = set()


def routing_config_of(layer: FusedMoE) -> RoutingConfig:
    """The routing config of a vLLM ``FusedMoE`` layer."""
    return RoutingConfig(
        top_k=layer.top_k,
        renormalize=layer.renormalize,
        use_grouped_topk=layer.use_grouped_topk,
        num_expert_group=layer.num_expert_group,
        topk_group=layer.topk_group,
        scoring_func=layer.scoring_func,
        routed_scaling_factor=layer.routed_scaling_factor,
        has_correction_bias=layer.e_score_correction_bias is not None,
        custom_routing_function=layer.custom_routing_function,
    )


def _expert_maps_of(layer: FusedMoE) -> list[torch.Tensor]:
    """Every EP rank's expert map, by recomputing vLLM's placement and matching this rank's map."""
    assert layer.expert_map is not None
    own = layer.expert_map.cpu()
    for strategy in ("linear", "round_robin"):
        _, candidate = determine_expert_map(layer.ep_size, layer.ep_rank, layer.global_num_experts, strategy)
        if candidate is not None and torch.equal(candidate, own):
            return [
                determine_expert_map(layer.ep_size, r, layer.global_num_experts, strategy)[1]  # type: ignore[misc]
                for r in range(layer.ep_size)
            ]
    raise ConfigError(f"{layer.layer_name}: the expert map matches neither linear nor round-robin placement")


def tokens_differ_per_ep_rank(layer: FusedMoE) -> bool:
    """Whether every EP rank holds different tokens (DP attention with attention TP 1): the all-to-all case."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    return bool(
        layer.use_ep
        and layer.dp_size > 1
        and get_tensor_model_parallel_world_size() == 1
        and not layer.is_sequence_parallel
    )


def dp_steps_padded(vllm_config: Any = None) -> bool:
    """Whether vLLM pads every data-parallel rank's step to one token count: always, unless ``--enforce-eager``
    (``GPUModelRunner.get_dp_padding``; the platform sets ``enforce_eager`` when graphs are off). With padding the
    DP exchanges take static shapes, which a captured or compiled graph can hold. ``vllm_config``: the config being
    built by default (without a model config nothing is padded)."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
    model = getattr(vllm_config, "model_config", None)
    return model is not None and not model.enforce_eager


def npu_settings() -> AdditionalConfig:
    """The plugin's settings of the config being built (defaults outside an engine)."""
    from vllm.config import get_current_vllm_config

    return AdditionalConfig.from_vllm(getattr(get_current_vllm_config(), "additional_config", None))


def _device_soc() -> str:
    from vllm.platforms import current_platform

    soc = getattr(getattr(current_platform, "device_backend", None), "soc", None)
    return str(soc()) if callable(soc) else ""


def _mc2_capacity() -> int:
    from vllm.config import get_current_vllm_config

    cfg = get_current_vllm_config()
    spec = getattr(cfg, "speculative_config", None)
    return mc2_tokens_capacity(cfg.scheduler_config.max_num_seqs, int(getattr(spec, "num_speculative_tokens", 0) or 0))


def _dp_step_tokens(hidden: torch.Tensor) -> int:
    """The step's largest per-DP-rank token count (the same on every rank), from vLLM's forward context.

    Traced (the torchair mode): the compiled size. vLLM pads every DP rank's batch to the largest one
    (``get_dp_padding``; the torchair mode never runs ``--enforce-eager``), so each rank's row count is that size, a
    static shape in the graph: the choice is made once per compiled size, not read from the host per step.
    """
    if torch.compiler.is_compiling():
        return int(hidden.shape[0])
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().dp_metadata
    return int(hidden.shape[0]) if meta is None else int(meta.max_tokens_across_dp_cpu)


def _mc2_comm(layer: FusedMoE, all_to_all: AllToAll | None) -> MC2Comm:
    """The MC2 kernels' group: vLLM's EP group (its HCCL communicator on the NPU, its all-to-all for the twin)."""
    from vllm.distributed import get_ep_group

    group = get_ep_group()
    name = ""
    if current_mode() is DeviceMode.NPU:
        backend: Any = group.device_group._get_backend(torch.device("npu"))  # torch_npu's ProcessGroupHCCL
        name = backend.get_hccl_comm_name(torch.distributed.get_rank(group=group.device_group))
    exchange = all_to_all or coordinator_all_to_all(group)
    return MC2Comm(group.rank_in_group, group.world_size, exchange, name, _device_soc())


def _check_310p_widths(layer: FusedMoE) -> None:
    """On an Ascend 310P ``npu_grouped_matmul`` writes output widths that are multiples of 16 only (torch_npu 2.8.0
    ``_op_plugin_docs.py:4572``): the expert MLP's ``2 * intermediate / TP`` and the hidden size."""
    gate_up, hidden = 2 * layer.intermediate_size_per_partition, layer.hidden_size
    chip = "the Atlas 300I (Ascend 310P) grouped matmul (npu_grouped_matmul) writes widths that are multiples of 16"
    if hidden % 16:
        raise ConfigError(f"{layer.layer_name}: MoE hidden size {hidden} cannot run on a 310P: {chip}")
    if gate_up % 16:
        raise ConfigError(
            f"{layer.layer_name}: the MoE gate/up width per tensor-parallel rank is {gate_up}, but {chip}; use a "
            "tensor-parallel size that leaves each rank a multiple of 8 of the expert intermediate size, or "
            "--enable-expert-parallel (whole experts per rank)"
        )


def build_layer_plan(
    layer: FusedMoE,
    *,
    all_to_all: AllToAll | None = None,
    allow_all_to_all: bool = True,
    placement: ExpertPlacement | None = None,
    mc2: str | None = None,
    dp_padded: bool | None = None,
) -> MoEPlan:
    """The :class:`MoEPlan` of a built vLLM ``FusedMoE`` layer (any quant method); see the module docstring.

    ``all_to_all`` overrides the EP group's exchange (tests); by default it is used only when
    :func:`uses_all_to_all` says so and ``allow_all_to_all`` is true. ``placement`` defaults to the layer's
    placement (``npu.expert_map_path``, or vLLM's EPLB placement with ``--enable-eplb``), ``mc2`` to ``npu.moe_mc2``,
    ``dp_padded`` to :func:`dp_steps_padded` (then the rows cross the ranks with static shapes, not the all-to-all).
    """
    if getattr(layer, "zero_expert_num", 0):
        raise ConfigError(f"{layer.layer_name}: zero experts (zero_expert_num > 0) are not supported by npu-ops' MoE")
    if getattr(layer.moe_config, "has_bias", False):
        raise ConfigError(f"{layer.layer_name}: MoE expert biases (has_bias=True) are not supported by npu-ops' MoE")
    if is_310p():
        _check_310p_widths(layer)
    kwargs: dict[str, Any] = {}
    settings = npu_settings()
    placement = placement or getattr(layer, "expert_placement", None)
    supplied_exchange = all_to_all
    gather_group = None
    if all_to_all is None and allow_all_to_all and tokens_differ_per_ep_rank(layer):
        from vllm.distributed import get_ep_group

        if dp_steps_padded() if dp_padded is None else dp_padded:
            # Graphs on (torchair, PIECEWISE, FULL_DECODE_ONLY: no --enforce-eager), so every DP rank runs the same
            # padded size (vLLM's DP padding) and the rows cross the ranks by all-gather and reduce-scatter of static
            # shapes: the all-to-all's split sizes would be read on the host inside a captured or compiled graph
            # (.capture). In graph and eager steps alike, so that a rank replaying a graph and a rank running eagerly
            # (FULL_DECODE_ONLY: one rank's step a pure decode, another's not) issue the same collectives. vllm-ascend
            # v0.11.0 also keeps the all-to-all out of captured sizes (MC2 or all-gather there).
            gather_group = get_ep_group().device_group
        else:
            all_to_all = coordinator_all_to_all(get_ep_group())
    exchange = all_to_all is not None or gather_group is not None
    if placement is not None:
        kwargs.update(placement=placement, ep_rank=layer.ep_rank, all_to_all=all_to_all, gather_group=gather_group)
    elif exchange:
        kwargs.update(
            all_to_all=all_to_all, gather_group=gather_group, ep_rank=layer.ep_rank, expert_maps=_expert_maps_of(layer)
        )
    else:
        kwargs.update(expert_map=layer.expert_map)
    setting = mc2 if mc2 is not None else settings.moe_mc2
    # The torchair mode changes nothing here: a compiled size takes MC2 or the other dispatcher once, when it is
    # traced (its padded size against the MC2 capacity), eager steps per step.
    if layer.use_ep and mc2_candidate(
        setting, npu=current_mode() is DeviceMode.NPU, soc=_device_soc(), ep_world=layer.ep_size
    ):
        where = placement or ExpertPlacement.from_expert_maps(_expert_maps_of(layer))
        if not where.uniform:
            if setting == "on":
                raise ConfigError(
                    f"{layer.layer_name}: npu.moe_mc2='on' needs the experts split evenly over the "
                    f"{layer.ep_size} expert-parallel ranks (slots per rank: {where.local_counts}); use a number of "
                    "experts divisible by the EP size, an even npu.expert_map_path, or npu.moe_mc2='auto'"
                )
        else:
            kwargs.update(
                placement=where,
                ep_rank=layer.ep_rank,
                mc2=_mc2_comm(layer, supplied_exchange),
                mc2_capacity=_mc2_capacity(),
                step_tokens=_dp_step_tokens if exchange else None,
            )
    plan = build_moe_plan(
        routing_config_of(layer),
        # router columns: the logical experts (vLLM's global_num_experts counts EPLB's redundant ones too)
        placement.num_logical if placement is not None else layer.global_num_experts,
        act_dtype=layer.moe_config.in_dtype,
        activation=layer.activation,
        apply_router_weight_on_input=layer.apply_router_weight_on_input,
        **kwargs,
    )
    logger.debug("%s: MoE gate=%s dispatcher=%s", layer.layer_name, plan.gate_path, type(plan.dispatcher).__name__)
    return plan


def moe_graph_refusal(layer: AscendFusedMoE) -> str | None:
    """Why this built layer cannot run inside a compiled (torchair) decode graph, or None.

    Inside the graph every op needs a GE converter and nothing may be read on the host: a quant method that declares
    npu-interface's ``MoEGraphTraceable`` (ours, npu-quant's MoE methods) qualifies with the plan's local dispatcher
    (no experts, or experts split over ranks that hold the same tokens), the gathered DP dispatcher (static shapes)
    and MC2 (its graph path sizes everything by its capacity; the choice is made per compiled size); the exchanges
    that size their messages on the host do not. Such a layer keeps vLLM's opaque op (the emulated device runs
    it; the platform refuses these configurations on an NPU, ``graphs/config.py``).
    """
    plan = layer.moe_plan
    if not traces_moe_in_graph(layer.quant_method):
        return (
            f"{type(layer.quant_method).__name__} does not declare MoEGraphTraceable (npu-interface): only quant "
            "methods whose apply runs graph-safe kernels are traced (npu-ops' unquantized one, npu-quant's MoE methods)"
        )
    if plan.host_sized:
        return "the all-to-all dispatcher reads its split sizes on the host"
    return None


class AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """Float experts through :func:`moe_forward`; weights stay in vLLM's layout (w13 [E, 2I, H], w2 [E, H, I])."""

    #: This method runs ``layer.moe_plan`` (npu-interface's LayerMoEPlanRunner: the layer may give the plan the
    #: all-to-all dispatcher under DP attention).
    uses_layer_moe_plan: ClassVar[bool] = True
    #: Its apply runs the plan's kernels only, all traceable (npu-interface's MoEGraphTraceable).
    traces_in_moe_graph: ClassVar[bool] = True
    #: Its expert tensors are vLLM's w13/w2 parameters, moved by vLLM's EPLB (npu-interface's EplbMovableExperts).
    moves_with_eplb: ClassVar[bool] = True

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # vLLM's version repacks weights for ROCm/CPU/XPU kernels; none of those run here, so nothing to do.
        return None

    def apply(  # type: ignore[override]
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        top_k: int,
        renormalize: bool,
        use_grouped_topk: bool = False,
        topk_group: int | None = None,
        num_expert_group: int | None = None,
        global_num_experts: int = -1,
        expert_map: torch.Tensor | None = None,
        custom_routing_function: Callable | None = None,
        scoring_func: str = "softmax",
        routed_scaling_factor: float = 1.0,
        e_score_correction_bias: torch.Tensor | None = None,
        apply_router_weight_on_input: bool = False,
        activation: str = "silu",
        enable_eplb: bool = False,
        **_: Any,
    ) -> torch.Tensor:
        plan: MoEPlan | None = getattr(layer, "moe_plan", None)
        if plan is None:
            raise RuntimeError(
                "AscendUnquantizedFusedMoEMethod.apply needs layer.moe_plan (built by AscendFusedMoE); "
                "build the layer through vLLM's FusedMoE with npu-ops registered"
            )
        w13, w2 = layer.w13_weight, layer.w2_weight
        assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)  # FusedMoE's registered parameters
        experts = plan.unquantized_experts(w13, w2)
        return moe_forward(
            x, router_logits, plan=plan, experts=experts, e_score_correction_bias=e_score_correction_bias
        )


class AscendFusedMoE(FusedMoE):
    """vLLM's ``FusedMoE`` with npu-ops' gating, permutation, grouped matmul and expert-parallel exchange."""

    moe_plan: MoEPlan
    expert_placement: ExpertPlacement | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(FusedMoE.__init__).bind(self, *args, **kwargs).arguments
        eplb = bool(bound.get("enable_eplb", False))
        with admit_eplb_quant_method(self, bound.get("quant_config"), eplb):
            super().__init__(*args, **kwargs)
        settings = npu_settings()
        self.expert_placement = None
        if self.enable_eplb:
            check_eplb_layer(self, expert_map_path=settings.expert_map_path)
            logical = int(bound["num_experts"])
            self.expert_placement = eplb_placement(
                logical, self.global_num_experts - logical, self.ep_size, layer_name=self.layer_name
            )
        elif settings.expert_map_path is not None:
            if not self.use_ep:
                raise ConfigError(
                    f"{self.layer_name}: npu.expert_map_path places experts over expert-parallel ranks; start with "
                    "--enable-expert-parallel (and tensor or data parallel > 1), or drop npu.expert_map_path"
                )
            self._place_experts(settings.expert_map_path, args, kwargs)
        if type(self.quant_method) is UnquantizedFusedMoEMethod:
            # Same create_weights (already run by vLLM); only apply/process_weights_after_loading differ.
            self.quant_method = AscendUnquantizedFusedMoEMethod(self.moe_config)
        # The all-to-all dispatcher lives in the plan, so it only helps a quant method that runs this plan
        # (LayerMoEPlanRunner); other methods get the all-gather / reduce-scatter of forward_impl.
        self.moe_plan = build_layer_plan(self, allow_all_to_all=runs_layer_moe_plan(self.quant_method))
        # DP ranks hold different tokens and the experts are split over the DP x TP ranks (whole experts per rank
        # with expert parallelism, a slice of every expert without it), so rows must cross the DP ranks here:
        # vLLM's DP dispatch/combine (forward_impl) goes through the device communicator's dispatch/combine, which
        # are no-ops on ours (left alone, each rank would sum only its own slice: wrong tokens).
        self._moe_across_dp = self.dp_size > 1
        #: Every DP rank runs the same number of tokens per step (vLLM's DP padding: graphs on, no --enforce-eager),
        #: so the DP exchanges take static shapes (.gathered) in graph and eager steps (.capture: no host reads in
        #: a captured or compiled graph).
        self._dp_padded = self._moe_across_dp and dp_steps_padded()
        if self._moe_across_dp and self.is_sequence_parallel:
            raise ConfigError(
                f"{self.layer_name}: sequence-parallel MoE with data parallel is not supported by npu-ops' MoE; "
                "start without --use-sequence-parallel-moe"
            )
        self._side_stream: SideStream | None = None
        if settings.multistream_overlap_shared_expert:
            api = device_stream_api()
            if api is not None:
                self._side_stream = SideStream(api)
        #: In the torchair mode the layer runs inside the compiled decode graph (forward_native calls forward_impl,
        #: not vLLM's opaque op) when its whole forward is traceable without host reads; else the opaque op stays.
        self.moe_graph_refusal = moe_graph_refusal(self) if settings.graph_mode == "torchair" else None
        self._moe_in_graph = settings.graph_mode == "torchair" and self.moe_graph_refusal is None
        if self.moe_graph_refusal is not None and self.moe_graph_refusal not in _LOGGED_REFUSALS:
            _LOGGED_REFUSALS.add(self.moe_graph_refusal)  # once per reason, not once per layer
            logger.info(
                "torchair mode: MoE layers stay vLLM's opaque moe_forward op in the compiled graph (%s)",
                self.moe_graph_refusal,
            )

    def forward_native(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self._moe_in_graph:
            return super().forward_native(hidden_states, router_logits)
        # vLLM's forward_native without its opaque op (torch.ops.vllm.moe_forward takes the layer's name and finds
        # the layer in the forward context in Python: no GE converter can follow it), as vLLM does on TPU; the
        # padding to the layer's hidden size is vLLM's.
        width = hidden_states.shape[-1]
        if self.hidden_size != width:
            hidden_states = torch.nn.functional.pad(hidden_states, (0, self.hidden_size - width))
        out = self.forward_impl(hidden_states, router_logits)
        if isinstance(out, tuple):
            return out[0][..., :width], out[1][..., :width]
        return out[..., :width]

    def set_eplb_state(
        self,
        moe_layer_idx: int,
        expert_load_view: torch.Tensor,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor,
    ) -> None:
        """vLLM's (the layer's views of ``EplbState``), then the plan's placement follows them and counts load."""
        super().set_eplb_state(moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count)
        if self.expert_placement is None:
            raise RuntimeError(f"{self.layer_name}: set_eplb_state on a layer built without --enable-eplb")
        follow_eplb_state(self.expert_placement, self)

    def get_expert_weights(self) -> Iterable[torch.Tensor]:
        """vLLM's list of the tensors its EPLB rearrangement moves (every parameter, viewed per expert), taken by
        the model's ``set_eplb_state`` after the weights are processed; first checked to hold every per-expert
        tensor the quant method's experts read, and only those (:func:`.eplb.check_expert_tensors`)."""
        check_expert_tensors(self)
        return super().get_expert_weights()

    def _place_experts(self, path: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Take this rank's slots of the static placement: expert map, local count, and weights re-created at it."""
        placement = load_expert_map(
            path, layer=layer_index(self.layer_name), num_logical=self.global_num_experts, world=self.ep_size
        )
        self.expert_placement = placement
        self.local_num_experts = placement.local_counts[self.ep_rank]
        self.register_buffer("expert_map", placement.expert_map(self.ep_rank))
        self.moe_config = dataclasses.replace(self.moe_config, num_local_experts=self.local_num_experts)
        if hasattr(self.quant_method, "moe"):
            self.quant_method.moe = self.moe_config
        for name in [n for n in self._parameters if n.startswith(("w13_", "w2_"))]:
            del self._parameters[name]
        bound = inspect.signature(FusedMoE.__init__).bind(self, *args, **kwargs)
        params_dtype = bound.arguments.get("params_dtype") or torch.get_default_dtype()
        self.quant_method.create_weights(
            layer=self,
            num_experts=self.local_num_experts,
            hidden_size=self.hidden_size,
            intermediate_size_per_partition=self.intermediate_size_per_partition,
            params_dtype=params_dtype,
            weight_loader=self.weight_loader,
        )
        logger.info(
            "%s: static expert placement from %s: rank %d holds experts %s",
            self.layer_name,
            path,
            self.ep_rank,
            placement.slots[self.ep_rank],
        )

    def _shared_and_routed(
        self, hidden_states: torch.Tensor, routed: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(shared experts' output or None, routed()): overlapped on the side stream when that is on."""
        shared_experts = self.shared_experts
        if shared_experts is None:
            return None, routed()
        if self._side_stream is not None:
            if torch.compiler.is_compiling():  # the torchair graph: torchair's stream scope, no stream objects
                return graph_overlap(shared_experts, routed, hidden_states, npu=kernel_backend() == "npu")
            return self._side_stream.overlap(shared_experts, routed, hidden_states)
        return shared_experts(hidden_states), routed()

    def forward_impl(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self._moe_across_dp and (self._side_stream is None or self.shared_experts is None):
            return super().forward_impl(hidden_states, router_logits)
        self.ensure_moe_quant_config()
        # Without DP this is vLLM's forward_impl (no dispatch/combine) with the shared experts overlapped. With DP:
        # the all-to-all plan's result is complete here, the gathered one a partial over the TP group's experts.
        gathered = self._moe_across_dp and not self.moe_plan.all_to_all
        run = self._gathered_apply if gathered else self._run_quant_method
        # An input with fewer rows than this rank's padded DP count (vLLM 0.11.0's DP dummy batch pads only the
        # counts; npu-platform's runner now runs it at the count, as vllm-ascend's model_runner_v1.py:2397-2399) is
        # padded with zero rows so every rank's exchange pairs up, and cut back. Only the routed experts exchange rows.
        rows = hidden_states.shape[0]
        step = dp_padded_rows(hidden_states, self.dp_rank) if self._moe_across_dp and self._dp_padded else rows
        routed_in = (pad_rows(hidden_states, step), pad_rows(router_logits, step))
        shared, routed = self._shared_and_routed(hidden_states, functools.partial(run, *routed_in))
        if step > rows:
            routed = routed[:rows]
        # As vLLM's forward_impl: sum the attention-TP ranks' partial outputs (a no-op when TP is 1).
        if self.reduce_results and not self.is_sequence_parallel and (self.tp_size > 1 or self.ep_size > 1):
            routed = self.maybe_all_reduce_tensor_model_parallel(routed)
            if shared is not None:
                shared = self.maybe_all_reduce_tensor_model_parallel(shared)
        return routed if shared is None else (shared, routed)

    def _gathered_apply(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Gather the DP ranks' tokens, let the quant method add this rank's experts, reduce-scatter the sums back.

        Used when the plan has no all-to-all (no expert parallelism, attention TP > 1, or a quant method that does
        not run ``layer.moe_plan``); the result is this rank's experts' share (without expert parallelism: its slice
        of every expert), summed over TP afterwards.
        """
        from vllm.distributed import get_dp_group

        dp = get_dp_group()
        if self._dp_padded:  # every DP rank holds the same number of tokens: static shapes, no size exchange
            rows = all_gather_rows(hidden_states, dp.device_group)
            logits = all_gather_rows(router_logits, dp.device_group)
            return reduce_scatter_rows(self._run_quant_method(rows, logits), dp.device_group)
        count = torch.tensor([hidden_states.shape[0]], dtype=torch.int64, device=hidden_states.device)
        sizes = [int(n) for n in host_ints(dp.all_gather(count, dim=0), "the DP ranks' token counts")]
        gathered = self._run_quant_method(
            dp.all_gatherv(hidden_states, dim=0, sizes=sizes), dp.all_gatherv(router_logits, dim=0, sizes=sizes)
        )
        return dp.reduce_scatterv(gathered, dim=0, sizes=sizes)

    # Not named _apply: that is nn.Module's hook behind .to()/.float()/.cuda(), which reaches every child module.
    def _run_quant_method(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(
            layer=self,
            x=hidden_states,
            router_logits=router_logits,
            top_k=self.top_k,
            renormalize=self.renormalize,
            use_grouped_topk=self.use_grouped_topk,
            global_num_experts=self.global_num_experts,
            expert_map=self.expert_map,
            topk_group=self.topk_group,
            num_expert_group=self.num_expert_group,
            custom_routing_function=self.custom_routing_function,
            scoring_func=self.scoring_func,
            routed_scaling_factor=self.routed_scaling_factor,
            e_score_correction_bias=self.e_score_correction_bias,
            activation=self.activation,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
            enable_eplb=self.enable_eplb,
            expert_load_view=self.expert_load_view,
            logical_to_physical_map=self.logical_to_physical_map,
            logical_replica_count=self.logical_replica_count,
        )
        if not isinstance(out, torch.Tensor):  # vLLM's type allows (shared, routed); shared experts run in forward
            raise TypeError(
                f"{type(self.quant_method).__name__}.apply returned {type(out).__name__}: AscendFusedMoE needs the "
                "routed experts' output tensor (it runs shared experts itself)"
            )
        return out


class AscendSharedFusedMoE(SharedFusedMoE, AscendFusedMoE):
    """vLLM's ``SharedFusedMoE`` (shared experts + routed experts) on :class:`AscendFusedMoE`.

    MRO: SharedFusedMoE -> AscendFusedMoE -> FusedMoE, so vLLM's shared-expert handling wraps our routed path.
    """
