# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-npu-plugin project
"""vllm_npu.ops.moe: FusedMoE for Ascend NPUs (gating, token permutation, grouped matmul, expert parallelism).

Import-light: exports load on first access. The layer classes (``AscendFusedMoE``, ``AscendSharedFusedMoE``) live
in ``.layer`` and import vLLM; the kernel modules import only torch.

For quantised MoE methods: build nothing yourself; the layer carries ``layer.moe_plan`` (a :class:`MoEPlan`), and
``moe_forward(x, router_logits, plan=layer.moe_plan, experts=<your ExpertsFn>, e_score_correction_bias=...)`` runs
gating, permutation, expert-parallel exchange and the weighted combine around your expert MLP. Declare
npu-interface's ``LayerMoEPlanRunner`` on the method (class attribute ``uses_layer_moe_plan = True``) so the layer
may give the plan its all-to-all dispatcher under DP attention. ``build_layer_plan(layer)`` builds a plan for a
vLLM ``FusedMoE`` that is not ours. A wheel that imports this door declares npu-ops in its pyproject (npu-quant: its
``moe`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Lazy exports (PEP 562): name -> ".module:attr", imported on first access. The TYPE_CHECKING block and
# __all__ mirror the table for type checkers and IDEs; tests/test_doors.py checks that the three agree.
_EXPORTS = {
    "AscendFusedMoE": ".layer:AscendFusedMoE",
    "AscendSharedFusedMoE": ".layer:AscendSharedFusedMoE",
    "AscendUnquantizedFusedMoEMethod": ".layer:AscendUnquantizedFusedMoEMethod",
    "build_layer_plan": ".layer:build_layer_plan",
    "routing_config_of": ".layer:routing_config_of",
    "ExpertsFn": ".experts:ExpertsFn",
    "UnquantizedExperts": ".experts:UnquantizedExperts",
    "grouped_matmul_npu": ".experts:grouped_matmul_npu",
    "grouped_matmul_reference": ".experts:grouped_matmul_reference",
    "MoEPlan": ".forward:MoEPlan",
    "build_moe_plan": ".forward:build_moe_plan",
    "moe_forward": ".forward:moe_forward",
    "RoutingConfig": ".gating:RoutingConfig",
    "build_gate": ".gating:build_gate",
}

if TYPE_CHECKING:
    from .experts import ExpertsFn, UnquantizedExperts, grouped_matmul_npu, grouped_matmul_reference
    from .forward import MoEPlan, build_moe_plan, moe_forward
    from .gating import RoutingConfig, build_gate
    from .layer import (
        AscendFusedMoE,
        AscendSharedFusedMoE,
        AscendUnquantizedFusedMoEMethod,
        build_layer_plan,
        routing_config_of,
    )
else:
    from vllm_npu.interface import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "AscendFusedMoE",
    "AscendSharedFusedMoE",
    "AscendUnquantizedFusedMoEMethod",
    "ExpertsFn",
    "MoEPlan",
    "RoutingConfig",
    "UnquantizedExperts",
    "build_gate",
    "build_layer_plan",
    "build_moe_plan",
    "grouped_matmul_npu",
    "grouped_matmul_reference",
    "moe_forward",
    "routing_config_of",
]
