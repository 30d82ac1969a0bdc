"""W8A8_DYNAMIC FusedMoE experts, plugged into npu-ops' MoE forward (gate -> dispatch -> experts -> combine).

Checkpoint tensors (vLLM's FusedMoE layout, loaded by ``FusedMoE.weight_loader`` from the per-expert
``experts.<e>.{gate,up,down}_proj.*`` tensors)::

    w13_weight [E, 2I, H] int8     w13_weight_scale [E, 2I, 1]   w13_weight_offset [E, 2I, 1] (must be 0)
    w2_weight  [E, H, I]  int8     w2_weight_scale  [E, H, 1]    w2_weight_offset  [E, H, 1]  (must be 0)

Expert maths for the rows routed to expert e (``dq`` = per-token dynamic int8 quant)::

    xq, s  = dq(x);   h = (xq @ W13[e]ᵀ) * s13[e] * s           (int8 grouped matmul, per-token dequant)
    hq, s' = dq(silu(h_gate) * h_up);   y = (hq @ W2[e]ᵀ) * s2[e] * s'

Gating, token permutation and expert-parallel dispatch are npu-ops' (:func:`vllm_npu.ops.moe.forward.moe_forward`);
this module only supplies the quantized ``experts`` function. Load-time processing: transposes to ``[E, H, 2I]`` /
``[E, I, H]`` and flattening of the scales, in :meth:`process_weights_after_loading`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.layer import FusedMoEMethodBase, FusedMoeWeightScaleSupported
from vllm_npu.interface import Kernel, require

from . import kernels
from .params import FLOATS, QuantLoadError, replace_param

# --------------------------------------------------------------------------------------------------------------
# int8 grouped matmul with per-channel weight scales and per-token activation scales


def _grouped_qmm_npu(
    xq: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pertoken: torch.Tensor, counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_grouped_matmul(
        [xq], [weight], scale=[scale], per_token_scale=[pertoken], group_list=counts.to(torch.int64),
        split_item=2, group_type=0, group_list_type=1, output_dtype=out_dtype,
    )[0]


def _grouped_qmm_ref(
    xq: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pertoken: torch.Tensor, counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """xq int8 ``[N, K]`` (rows sorted by group), weight int8 ``[G, K, M]``, scale float32 ``[G, M]``, pertoken
    float32 ``[N]``, counts int64 ``[G]`` -> ``[N, M]``: ``(xq_g @ W[g]) * scale[g] * pertoken_g``."""
    sizes = counts.tolist()
    if len(sizes) != weight.shape[0] or sum(sizes) != xq.shape[0]:
        raise ValueError(f"grouped matmul: counts {sizes} do not fit {xq.shape[0]} rows / {weight.shape[0]} groups")
    out = torch.empty(xq.shape[0], weight.shape[-1], dtype=out_dtype, device=xq.device)
    start = 0
    for g, n in enumerate(sizes):
        if n:
            acc = xq[start:start + n].to(torch.float64) @ weight[g].to(torch.float64)  # exact for int8
            res = acc.to(torch.float32) * scale[g].to(torch.float32) * pertoken[start:start + n].unsqueeze(-1)
            out[start:start + n] = res.to(out_dtype)
        start += n
    return out


grouped_quant_matmul = Kernel("npu_grouped_matmul[int8,per-token]", npu=_grouped_qmm_npu, reference=_grouped_qmm_ref)


class W8A8DynamicExperts:
    """The :data:`vllm_npu.ops.moe.experts.ExpertsFn` over processed weights (w13 [E, H, 2I], w2 [E, I, H])."""

    def __init__(self, layer: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.layer = layer
        self.activation = activation
        self._dq = kernels.dynamic_quant.select()
        self._gqmm = grouped_quant_matmul.select()

    def __call__(self, rows: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        xq, s = self._dq(rows)
        h = self._gqmm(xq, layer.w13_weight, layer.w13_weight_scale, s, group_counts, rows.dtype)
        hq, s2 = self._dq(self.activation(h))
        return self._gqmm(hq, layer.w2_weight, layer.w2_weight_scale, s2, group_counts, rows.dtype)


class AscendW8A8DynamicFusedMoEMethod(FusedMoEMethodBase):
    """W8A8_DYNAMIC experts for vLLM's ``FusedMoE`` (and npu-ops' override of it)."""

    def __init__(self, moe: Any, prefix: str) -> None:
        super().__init__(moe)
        self.prefix = prefix
        self._loads: dict[str, set[tuple[int, str]]] = {}
        self._plan: Any = None
        self._experts: W8A8DynamicExperts | None = None

    # --- weights ----------------------------------------------------------------------------------------------------
    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        from vllm.model_executor.utils import set_weight_attrs

        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        loader = extra_weight_attrs.pop("weight_loader")
        specs: list[tuple[str, tuple[int, ...], torch.dtype, tuple[torch.dtype, ...], dict[str, Any]]] = [
            ("w13_weight", (e, 2 * i, h), torch.int8, (torch.int8,), {}),
            ("w2_weight", (e, h, i), torch.int8, (torch.int8,), {}),
            ("w13_weight_scale", (e, 2 * i, 1), torch.float32, FLOATS, {"quant_method": FusedMoeWeightScaleSupported.CHANNEL.value}),
            ("w2_weight_scale", (e, h, 1), torch.float32, FLOATS, {"quant_method": FusedMoeWeightScaleSupported.CHANNEL.value}),
            ("w13_weight_offset", (e, 2 * i, 1), torch.float32, FLOATS, {"quant_method": FusedMoeWeightScaleSupported.CHANNEL.value}),
            ("w2_weight_offset", (e, h, 1), torch.float32, FLOATS, {"quant_method": FusedMoeWeightScaleSupported.CHANNEL.value}),
        ]
        self.num_local_experts = e
        for name, shape, dtype, accept, attrs in specs:
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {**extra_weight_attrs, **attrs, "weight_loader": self._wrap(name, accept, dtype, loader)})

    def _wrap(self, name: str, accept: tuple[torch.dtype, ...], dtype: torch.dtype, inner: Callable[..., Any]) -> Callable[..., Any]:
        full = f"{self.prefix}.{name}"

        def load(param: torch.nn.Parameter, loaded: torch.Tensor, weight_name: str, shard_id: str, expert_id: int,
                 *args: Any, **kwargs: Any) -> Any:
            if loaded.dtype not in accept:
                raise QuantLoadError(
                    f"checkpoint tensor {weight_name!r} (-> {full}, expert {expert_id}, {shard_id}) has dtype "
                    f"{loaded.dtype}, expected one of {', '.join(map(str, accept))}; the checkpoint does not match its "
                    "quant_model_description.json: re-export it"
                )
            try:
                result = inner(param, loaded.to(dtype), weight_name, shard_id, expert_id, *args, **kwargs)
            except (AssertionError, RuntimeError) as exc:
                raise QuantLoadError(
                    f"checkpoint tensor {weight_name!r} (-> {full}, expert {expert_id}, {shard_id}) has shape "
                    f"{tuple(loaded.shape)}, which does not fit the expert slice of {tuple(param.shape)} ({exc})"
                ) from None
            if result is not False:
                self._loads.setdefault(name, set()).add((int(expert_id), str(shard_id)))
            return result

        return load

    def _check_complete(self) -> None:
        e = self.num_local_experts
        need = {"w13_weight": 2 * e, "w2_weight": e, "w13_weight_scale": 2 * e, "w2_weight_scale": e}
        missing = [f"{self.prefix}.{n} ({len(self._loads.get(n, ()))}/{k} expert shards)" for n, k in need.items()
                   if len(self._loads.get(n, ())) < k]
        if missing:
            raise QuantLoadError(
                f"the checkpoint does not provide all expert tensors that quant_model_description.json promises: "
                f"{', '.join(missing)}; re-export the checkpoint"
            )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._check_complete()
        for name in ("w13_weight_offset", "w2_weight_offset"):
            if name in self._loads and bool((getattr(layer, name) != 0).any()):
                raise QuantLoadError(f"{self.prefix}.{name} has non-zero values: asymmetric expert weights are not "
                                     "supported; re-export with symmetric quantization")
            del layer._parameters[name]
        for name in ("w13_weight_scale", "w2_weight_scale"):
            s = getattr(layer, name).data
            if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
                raise QuantLoadError(f"{self.prefix}.{name} must be finite and > 0")
            replace_param(layer, name, s.reshape(s.shape[0], -1).float().contiguous())  # [E, N]
        replace_param(layer, "w13_weight", layer.w13_weight.data.transpose(1, 2).contiguous())  # [E, H, 2I]
        replace_param(layer, "w2_weight", layer.w2_weight.data.transpose(1, 2).contiguous())  # [E, I, H]
        self._build(layer)

    def _build(self, layer: torch.nn.Module) -> None:
        """Choose every kernel once: npu-ops' plan (gate, dispatcher, activation; ``layer.moe_plan`` when the layer
        is npu-ops' AscendFusedMoE, else built the same way) plus our quantized experts."""
        plan = getattr(layer, "moe_plan", None)
        if plan is None:
            try:
                from vllm_npu.ops.moe.layer import build_layer_plan
            except ImportError:
                require("ops", "W8A8_DYNAMIC MoE experts run inside npu-ops' MoE forward")
                raise
            plan = build_layer_plan(layer)
        self._plan = plan
        self._experts = W8A8DynamicExperts(layer, plan.activation)

    # --- forward ----------------------------------------------------------------------------------------------------
    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None  # our experts do not run through vLLM's modular kernels

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, router_logits: torch.Tensor, top_k: int,
              renormalize: bool, *args: Any, **kwargs: Any) -> torch.Tensor:
        from vllm_npu.ops.moe.forward import moe_forward

        if self._plan is None or self._experts is None:
            raise RuntimeError(f"{self.prefix}: process_weights_after_loading has not run")
        if kwargs.get("enable_eplb"):
            raise NotImplementedError("EPLB is not supported with W8A8_DYNAMIC experts")
        return moe_forward(x, router_logits, plan=self._plan, experts=self._experts,
                           e_score_correction_bias=kwargs.get("e_score_correction_bias"))
