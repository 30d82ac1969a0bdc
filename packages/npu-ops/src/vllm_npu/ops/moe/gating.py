# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""MoE gating: router logits -> (top-k weights, top-k expert ids).

Every gate built here has the one contract::

    gate(hidden_states [T, H], router_logits [T, E], e_score_correction_bias [E] | None)
        -> (topk_weights [T, k] float32, topk_ids [T, k] int32)

The order of the k entries of a row is not part of the contract (vLLM's own grouped top-k is unsorted); the set of
(id, weight) pairs is. Semantics follow vLLM 0.11's ``FusedMoE.select_experts`` exactly, including its quirk that
``routed_scaling_factor`` is applied only on the grouped and correction-bias paths (models such as DeepSeek-V2/V3
pass 1.0 and scale outside).

Two NPU kernels, each with its pure-PyTorch reference twin right below it:

- ``npu_moe_gating_top_k_softmax``: softmax top-k without grouping or bias (Mixtral, Qwen-MoE, ...);
- ``npu_moe_gating_top_k``: grouped top-k with sigmoid scores and renormalisation (DeepSeek-V3 ``noaux_tc``),
  with an optional correction bias.

Every other routing config (custom routing functions, a correction bias without grouping, sigmoid without
renormalisation, softmax grouped top-k, group shapes the fused op rejects) uses :func:`select_experts_native`,
plain torch that runs the same on the NPU and on the emulated device. The choice is made once, by
:func:`build_gate`, when the layer is built. On an Ascend 310P every config takes the torch path (:func:`gate_path`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm_npu.interface import ConfigError, Kernel, KernelBackend, is_310p

GateOutput = tuple[torch.Tensor, torch.Tensor]
Gate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], GateOutput]

# npu_moe_gating_top_k's documented eps for the sigmoid renormalisation (sum + eps).
GATING_EPS = 1e-20
# Limits of npu_moe_gating_top_k (torch_npu 2.8.0 docs): at most 2048 experts; experts per group > 2; the per-group
# width rounded up to 32, times the group count, at most 2048.
_MAX_EXPERTS = 2048


@dataclass(frozen=True, eq=False)
class RoutingConfig:
    """The routing knobs of a vLLM ``FusedMoE`` layer (same names and meaning)."""

    top_k: int
    renormalize: bool = True
    use_grouped_topk: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False
    custom_routing_function: Callable[..., GateOutput] | None = None

    def validate(self, num_experts: int) -> None:
        if not 1 <= self.top_k <= num_experts:
            raise ConfigError(f"MoE top_k={self.top_k} must be in [1, num_experts={num_experts}]")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"MoE scoring_func={self.scoring_func!r} is not supported; use 'softmax' or 'sigmoid'")
        if self.use_grouped_topk:
            g, kg = self.num_expert_group, self.topk_group
            if g is None or kg is None or g <= 0 or not 1 <= kg <= g:
                raise ConfigError(
                    f"grouped top-k needs num_expert_group > 0 and 1 <= topk_group <= num_expert_group "
                    f"(got num_expert_group={g}, topk_group={kg})"
                )
            if num_experts % g:
                raise ConfigError(f"num_experts={num_experts} is not divisible by num_expert_group={g}")
            if self.has_correction_bias and num_experts // g < 2:
                raise ConfigError(
                    "a correction bias scores each group by its top-2 experts: need >= 2 experts per group"
                )
            if self.top_k > kg * (num_experts // g):
                raise ConfigError(
                    f"top_k={self.top_k} exceeds the experts left after keeping topk_group={kg} of {g} groups"
                )


# --- softmax top-k (no groups, no bias) ---------------------------------------------------------------------------


def topk_softmax_npu(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> GateOutput:
    """``topk(softmax(logits))`` with the fused NPU op; logits [T, E] any float dtype (computed in float32)."""
    import torch_npu

    weights, ids, _row_idx = torch_npu.npu_moe_gating_top_k_softmax(router_logits.float(), None, k=top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.float(), ids.to(torch.int32)


def topk_softmax_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> GateOutput:
    """Reference twin of :func:`topk_softmax_npu` (same contract; ids sorted by descending weight)."""
    weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


TOPK_SOFTMAX = Kernel("moe_gating_topk_softmax", npu=topk_softmax_npu, reference=topk_softmax_reference)


# --- grouped top-k (DeepSeek-V2/V3 style) ------------------------------------------------------------------------


def grouped_topk_npu(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str,
    routed_scaling_factor: float,
) -> GateOutput:
    """Grouped top-k with ``npu_moe_gating_top_k``.

    Contract (see :func:`grouped_topk_reference`): scores ``s = sigmoid(x)`` (renormalised with eps afterwards) or
    ``softmax(x)`` (not renormalised); a group scores the sum of its top-2 ``s + bias`` with a bias, else its max;
    the best ``topk_group`` groups are kept; the ``top_k`` experts by ``s + bias`` inside them are chosen; their
    weights are the unbiased ``s`` times ``routed_scaling_factor``.
    """
    import torch_npu

    x = router_logits.float()
    weights, ids, _norm = torch_npu.npu_moe_gating_top_k(
        x,
        top_k,
        bias=None if bias is None else bias.to(x.dtype),
        k_group=topk_group,
        group_count=num_expert_group,
        group_select_mode=0 if bias is None else 1,
        renorm=0,
        norm_type=1 if scoring_func == "sigmoid" else 0,
        out_flag=False,
        routed_scaling_factor=routed_scaling_factor,
        eps=GATING_EPS,
    )
    return weights.float(), ids.to(torch.int32)


def _scores(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    x = router_logits.float()
    return x.sigmoid() if scoring_func == "sigmoid" else torch.softmax(x, dim=-1)


def _grouped_choice(
    scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, num_expert_group: int, topk_group: int
) -> torch.Tensor:
    """Expert ids [T, k] (int64) of grouped top-k: groups scored by their max (no bias) or the sum of their top-2
    biased scores; the best ``topk_group`` groups kept; the top-k biased scores inside them."""
    choice = scores if bias is None else scores + bias.float().unsqueeze(0)
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
    group_scores = grouped.max(dim=-1).values if bias is None else grouped.topk(2, dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    # expand + reshape, not repeat_interleave: GE has no converter for aten.repeat_interleave (torchair graphs)
    per_group = num_experts // num_expert_group
    expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_expert_group, per_group).reshape(num_tokens, -1)
    return choice.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices


def grouped_topk_reference(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str,
    routed_scaling_factor: float,
) -> GateOutput:
    """Reference twin of :func:`grouped_topk_npu`: logits [T, E], bias [E] or None -> float32 [T, k], int32 [T, k]."""
    sigmoid = scoring_func == "sigmoid"
    scores = _scores(router_logits, scoring_func)
    ids = _grouped_choice(scores, bias, top_k, num_expert_group, topk_group)
    weights = scores.gather(1, ids)
    if sigmoid:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + GATING_EPS)
    return weights * routed_scaling_factor, ids.to(torch.int32)


GROUPED_TOPK = Kernel("moe_gating_grouped_topk", npu=grouped_topk_npu, reference=grouped_topk_reference)


def fused_grouped_topk_supports(cfg: RoutingConfig, num_experts: int) -> bool:
    """Whether ``npu_moe_gating_top_k`` computes exactly vLLM's grouped top-k for this config.

    Only sigmoid scoring with renormalisation (DeepSeek-V3's ``noaux_tc``): the op renormalises sigmoid weights
    (with eps), which is what vLLM does for ``renormalize=True``. Whether it renormalises softmax weights is not
    stated in the docs, so softmax grouped configs take the torch path. The shape limits are the documented ones.
    """
    if not cfg.use_grouped_topk or cfg.custom_routing_function is not None:
        return False
    if cfg.scoring_func != "sigmoid" or not cfg.renormalize:
        return False
    g, kg = cfg.num_expert_group or 0, cfg.topk_group or 0
    if g <= 0 or num_experts % g or num_experts > _MAX_EXPERTS:
        return False
    per_group = num_experts // g
    return per_group > 2 and -(-per_group // 32) * 32 * g <= _MAX_EXPERTS and 1 <= kg <= g


# --- the general torch path ------------------------------------------------------------------------------------


def select_experts_native(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    cfg: RoutingConfig,
) -> GateOutput:
    """Every routing config vLLM 0.11 accepts, in plain torch (used on both backends for the non-fused configs)."""
    if cfg.use_grouped_topk:
        assert cfg.num_expert_group is not None and cfg.topk_group is not None
        scores = _scores(router_logits, cfg.scoring_func)
        ids = _grouped_choice(scores, e_score_correction_bias, cfg.top_k, cfg.num_expert_group, cfg.topk_group)
        weights = scores.gather(1, ids)
        if cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        return weights, ids.to(torch.int32)
    if e_score_correction_bias is not None:
        # vLLM's fused_topk_bias: softmax scores, biased choice, unbiased weights, then the scaling factor.
        scores = torch.softmax(router_logits.float(), dim=-1)
        ids = (scores + e_score_correction_bias.float().unsqueeze(0)).topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * cfg.routed_scaling_factor, ids.to(torch.int32)
    if cfg.custom_routing_function is not None:
        weights, ids = cfg.custom_routing_function(
            hidden_states=hidden_states, gating_output=router_logits, topk=cfg.top_k, renormalize=cfg.renormalize
        )
        return weights.float(), ids.to(torch.int32)
    weights, ids = _scores(router_logits, cfg.scoring_func).topk(cfg.top_k, dim=-1)
    if cfg.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# --- selection ---------------------------------------------------------------------------------------------------


def gate_path(cfg: RoutingConfig, num_experts: int) -> str:
    """Which path :func:`build_gate` takes: ``"topk_softmax"``, ``"grouped_topk"`` or ``"native"``.

    Always ``"native"`` on an Ascend 310P: torch_npu 2.8.0 documents both fused gating ops for A2/A3 only, and
    ``MoeGatingTopKSoftmax`` has no 310P kernel (vllm-ascend issue #1813; vllm-ascend v0.11.0 calls it on every
    chip, ``ops/moe/experts_selector.py:199``; its Pangu Pro MoE, the model it runs on a 310P, gates in torch)."""
    if is_310p():
        return "native"
    if fused_grouped_topk_supports(cfg, num_experts):
        return "grouped_topk"
    plain = not cfg.use_grouped_topk and not cfg.has_correction_bias and cfg.custom_routing_function is None
    if plain and cfg.scoring_func == "softmax":
        return "topk_softmax"
    return "native"


def build_gate(cfg: RoutingConfig, num_experts: int, backend: KernelBackend | None = None) -> Gate:
    """Pick the gating kernel once for a layer; returns a :data:`Gate`."""
    cfg.validate(num_experts)
    path = gate_path(cfg, num_experts)
    if path == "topk_softmax":
        topk_softmax = TOPK_SOFTMAX.select(backend)

        def softmax_gate(
            hidden_states: torch.Tensor, router_logits: torch.Tensor, bias: torch.Tensor | None
        ) -> GateOutput:
            return topk_softmax(router_logits, cfg.top_k, cfg.renormalize)

        return softmax_gate
    if path == "grouped_topk":
        assert cfg.num_expert_group is not None and cfg.topk_group is not None
        grouped = functools.partial(
            GROUPED_TOPK.select(backend),
            top_k=cfg.top_k,
            num_expert_group=cfg.num_expert_group,
            topk_group=cfg.topk_group,
            scoring_func=cfg.scoring_func,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )

        def grouped_gate(
            hidden_states: torch.Tensor, router_logits: torch.Tensor, bias: torch.Tensor | None
        ) -> GateOutput:
            if cfg.has_correction_bias and bias is None:
                raise ValueError("this MoE layer was built with a correction bias but none was passed")
            return grouped(router_logits, bias)

        return grouped_gate

    def gate(hidden_states: torch.Tensor, router_logits: torch.Tensor, bias: torch.Tensor | None) -> GateOutput:
        return select_experts_native(hidden_states, router_logits, bias, cfg)

    return gate
